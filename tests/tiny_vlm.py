"""Tiny vision-language models built locally, so the image tests never touch the network.

A Qwen2-VL (flattened patches: ``pixel_values`` is ``(total_patches, patch_dim)``, cut per image by
``image_grid_thw``) whose patch size is 4, so an 8x8 image is 4 patches and a 16x16 image 16: images of
different sizes give every image its own number of rows in ``pixel_values``, which is what a
per-sample slicer must get right. Its processor is a ``Qwen2VLProcessor`` over a word-level tokenizer
that knows Qwen2-VL's vision tokens and a ChatML chat template. The model loads with
``SentenceTransformer(path)`` on releases whose ``Transformer`` takes images.

A CLIP (per-row pixels: ``pixel_values`` is ``(images, C, H, W)``) with its ``CLIPProcessor``,
for the other layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import WORDS
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import AutoProcessor, PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLProcessor

PAD, EOS, UNK = "<|endoftext|>", "<|im_end|>", "<|unk|>"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIAL_TOKENS = [PAD, UNK, "<|im_start|>", EOS, *VISION_TOKENS]
ROLES = ["system", "user", "assistant", "query", "document"]
VOCAB = list(dict.fromkeys(SPECIAL_TOKENS + ROLES + WORDS + [str(d) for d in range(10)]))

#: ChatML, with an image placeholder where a message holds an image. Every role is rendered, so
#: query/document pairs keep both halves.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
)

PATCH_SIZE = 4
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
#: Images are resized to multiples of this, between one and 64 merged tokens.
IMAGE_FACTOR = PATCH_SIZE * MERGE_SIZE


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer whose special tokens include Qwen2-VL's vision tokens."""
    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=EOS,
        model_max_length=256,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )


def qwen2_vl_config(hidden_size: int = 32, num_layers: int = 2, vision_depth: int = 1) -> Qwen2VLConfig:
    token_id = {token: index for index, token in enumerate(VOCAB)}
    # mrope splits the rotary half of each head (4 heads) between temporal, height and width positions.
    half = hidden_size // 4 // 2
    mrope_section = [half - 2 * (half // 4), half // 4, half // 4]
    return Qwen2VLConfig(
        text_config={
            "vocab_size": len(VOCAB),
            "hidden_size": hidden_size,
            "intermediate_size": hidden_size * 2,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
            "bos_token_id": token_id[PAD],
            "eos_token_id": token_id[EOS],
            "pad_token_id": token_id[PAD],
        },
        vision_config={
            "depth": vision_depth,
            "embed_dim": 16,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
        image_token_id=token_id["<|image_pad|>"],
        video_token_id=token_id["<|video_pad|>"],
        vision_start_token_id=token_id["<|vision_start|>"],
        vision_end_token_id=token_id["<|vision_end|>"],
    )


class TinyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor.

    transformers builds Qwen2-VL's video processor on torchvision, which is not a dependency here; images
    need the image processor alone. Registered with AutoProcessor on import, so that
    ``AutoProcessor.from_pretrained`` (and so sentence-transformers) finds it by the class name the saved
    directory records.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


AutoProcessor.register(Qwen2VLConfig, TinyQwen2VLProcessor, exist_ok=True)


def build_qwen2_vl_processor():
    """The tiny Qwen2-VL's processor: 4-pixel patches, the word-level tokenizer, the ChatML template."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixel_range = {"min_pixels": IMAGE_FACTOR * IMAGE_FACTOR, "max_pixels": 64 * IMAGE_FACTOR * IMAGE_FACTOR}
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, **pixel_range
    )
    return TinyQwen2VLProcessor(
        image_processor=image_processor, tokenizer=build_vlm_tokenizer(), chat_template=CHAT_TEMPLATE
    )


def save_tiny_qwen2_vl(path: Path, *, seed: int = 0) -> Path:
    """Save a randomly initialised tiny Qwen2-VL with its processor to ``path``."""
    from transformers import Qwen2VLModel

    torch.manual_seed(seed)
    model = Qwen2VLModel(qwen2_vl_config())
    model.save_pretrained(path)
    build_qwen2_vl_processor().save_pretrained(path)
    return path


def noise_image(width: int, height: int, seed: int):
    """A deterministic noise image: distinct pixels per seed, so every image embeds differently."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


CLIP_IMAGE_SIZE = 16


def build_clip_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer with CLIP's framing: every text ends in the EOS token CLIP pools at."""
    tokenizer = build_vlm_tokenizer()
    backend = tokenizer.backend_tokenizer
    bos, eos = "<|im_start|>", EOS
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, VOCAB.index(bos)), (eos, VOCAB.index(eos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=UNK, pad_token=PAD, bos_token=bos, eos_token=eos, model_max_length=64
    )


def save_tiny_clip(path: Path, *, seed: int = 0, hidden_size: int = 32) -> Path:
    """Save a randomly initialised tiny CLIP (16x16 images in 4x4 patches) with its processor."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    shared = {
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    config = CLIPConfig(
        text_config={
            **shared,
            "vocab_size": len(VOCAB),
            "max_position_embeddings": 64,
            "pad_token_id": VOCAB.index(PAD),
            "bos_token_id": VOCAB.index("<|im_start|>"),
            "eos_token_id": VOCAB.index(EOS),
        },
        vision_config={**shared, "image_size": CLIP_IMAGE_SIZE, "patch_size": 4},
        projection_dim=hidden_size,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(path)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": CLIP_IMAGE_SIZE}, crop_size={"height": CLIP_IMAGE_SIZE, "width": CLIP_IMAGE_SIZE}
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=build_clip_tokenizer()).save_pretrained(path)
    return path
