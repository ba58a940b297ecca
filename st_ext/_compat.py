"""The one place that knows which upstream versions are installed, how they differ, and which private APIs st_ext uses.

Supported: sentence-transformers 4.1.0 … 6.2.0 on transformers 4.51 … 5.x; importing this module with a
release outside pyproject's range raises an ImportError naming the fix. The rest of st_ext asks this module
instead of comparing versions, probing upstream classes for features or reaching into private APIs
(tests/test_private_api.py enforces the last).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from types import ModuleType
from typing import Any, TypeGuard

import sentence_transformers
import sentence_transformers.util as st_util
import torch
import torch.distributed as dist
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import Tensor, nn

from st_ext.scoped_entries import entries_set

ST_VERSION = Version(sentence_transformers.__version__)

#: pyproject's requirement on sentence-transformers, and the oldest and newest releases tested.
ST_REQUIREMENT = ">=4.1.0,<6.3"
MIN_ST_VERSION = Version("4.1.0")
MAX_ST_VERSION = Version("6.2.0")


def check_supported_version(version: str | Version) -> None:
    """Raise an ImportError saying how to fix it unless sentence-transformers ``version`` is supported."""
    if not SpecifierSet(ST_REQUIREMENT).contains(Version(str(version)), prereleases=True):
        raise ImportError(
            f"st_ext supports sentence-transformers {MIN_ST_VERSION} … {MAX_ST_VERSION} "
            f"('sentence-transformers{ST_REQUIREMENT}'), but sentence-transformers {version} is installed. "
            f"Install a supported release with: pip install 'sentence-transformers{ST_REQUIREMENT}'",
            name="sentence_transformers",
        )


check_supported_version(ST_VERSION)

#: Upstream ``CrossEncoder`` has ``gradient_checkpointing_enable`` (added in 5.0.0, upstream PR #3331).
CROSS_ENCODER_HAS_CHECKPOINTING = ST_VERSION >= Version("5.0.0")
#: ``MarginMSELoss`` takes (query, positive, negative_1..n) from 5.0.0; before, exactly one negative.
MARGIN_MSE_TAKES_MANY_NEGATIVES = ST_VERSION >= Version("5.0.0")

#: Whether DDP's ``no_sync`` keeps track of the parameters a held backward used when it searches for
#: unused ones (torch 2.4, pytorch PR #124193).
DDP_NO_SYNC_TRACKS_UNUSED_PARAMETERS = Version(torch.__version__).release >= (2, 4)
#: transformers 5 renamed ``gradient_checkpointing_*`` to ``activation_checkpointing_*`` (the old names warn that
#: they "will be removed in v6") and defaults ``use_reentrant`` to False; transformers 4 has only the old names.
HF_HAS_ACTIVATION_CHECKPOINTING = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
#: What the installed transformers' checkpointing switch takes besides the ``torch.utils.checkpoint`` arguments
#: (transformers 5.24: ``every_n_layers``, ``offload``); a Trainer takes them in ``gradient_checkpointing_kwargs``.
HF_CHECKPOINTING_OPTIONS = frozenset(
    inspect.signature(
        getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
        or transformers.PreTrainedModel.gradient_checkpointing_enable
    ).parameters
) - {"self", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs", "kwargs"}
TRANSFORMERS_VERSION = Version(transformers.__version__)

#: The first sentence-transformers release of each archetype beyond SentenceTransformer and CrossEncoder.
ARCHETYPE_SINCE = {"SparseEncoder": Version("5.0.0"), "MultiVectorEncoder": Version("6.0.0")}
HAS_SPARSE_ENCODER = ST_VERSION >= ARCHETYPE_SINCE["SparseEncoder"]
HAS_MULTI_VECTOR_ENCODER = ST_VERSION >= ARCHETYPE_SINCE["MultiVectorEncoder"]
#: Each public name an archetype brings (model, trainer, training arguments), with its archetype.
ARCHETYPE_OF_NAME = {
    archetype + suffix: archetype for archetype in ARCHETYPE_SINCE for suffix in ("", "Trainer", "TrainingArguments")
}


def missing_archetype_error(name: str) -> ImportError | None:
    """The ImportError for ``name`` when it belongs to an archetype the installed release lacks, else None."""
    archetype = ARCHETYPE_OF_NAME.get(name)
    since = None if archetype is None else ARCHETYPE_SINCE.get(archetype)
    if since is None or ST_VERSION >= since:
        return None
    return ImportError(
        f"{name} needs sentence-transformers >= {since} (where {archetype} first appeared); "
        f"sentence-transformers {ST_VERSION} is installed. "
        f"Upgrade with: pip install -U 'sentence-transformers>={since}'",
        name=name,
    )


def upstream_model_classes() -> tuple[type, ...]:
    """The installed release's model classes: containers whose Hugging Face models st_ext switches itself."""
    names = ["SentenceTransformer", "CrossEncoder"]
    names += [archetype for archetype, since in ARCHETYPE_SINCE.items() if ST_VERSION >= since]
    return tuple(getattr(sentence_transformers, name) for name in names)


def st_modules() -> ModuleType:
    """The namespace of ``Transformer``, ``Pooling``, ``Asym``… (6.0 moved it; the old path warns)."""
    path = "sentence_transformer.modules" if ST_VERSION >= Version("6.0.0") else "models"
    return importlib.import_module(f"sentence_transformers.{path}")


def st_losses() -> ModuleType:
    """The ``losses`` namespace for SentenceTransformer models (5.4 moved it; the old path warns)."""
    path = "sentence_transformer.losses" if ST_VERSION >= Version("5.4.0") else "losses"
    return importlib.import_module(f"sentence_transformers.{path}")


def preprocess(model: nn.Module, texts: list, device: str | torch.device | None = None) -> dict:
    """Tokenize ``texts`` for ``model`` (``tokenize`` was renamed ``preprocess`` in 5.4), on ``device`` if given."""
    method = getattr(model, "preprocess", None) or getattr(model, "tokenize")
    features = method(texts)
    if device is None:
        return features
    return {key: value.to(device) if isinstance(value, Tensor) else value for key, value in features.items()}


def embedding_dimension(model: nn.Module) -> int | None:
    """The model's output embedding size (``get_sentence_embedding_dimension`` was renamed in 6.0)."""
    method = getattr(model, "get_embedding_dimension", None) or getattr(model, "get_sentence_embedding_dimension")
    return method()


def _hf_name(name: str) -> str:
    """``name`` (``checkpointing_enable``…) as the installed transformers prefers to spell it."""
    return ("activation_" if HF_HAS_ACTIVATION_CHECKPOINTING else "gradient_") + name


def hf_checkpointing_enable(model: transformers.PreTrainedModel, checkpoint_kwargs: dict, **extra: Any) -> None:
    """Switch checkpointing on in a Hugging Face model; ``extra`` (transformers 5's ``every_n_layers``,
    ``offload``) is passed only where accepted."""
    method = getattr(model, _hf_name("checkpointing_enable"))
    method(**{_hf_name("checkpointing_kwargs"): checkpoint_kwargs}, **accepted_kwargs(method, extra))


def hf_checkpointing_disable(model: transformers.PreTrainedModel) -> None:
    getattr(model, _hf_name("checkpointing_disable"))()


def hf_is_checkpointing(model: transformers.PreTrainedModel) -> bool:
    return bool(getattr(model, "is_" + _hf_name("checkpointing")))


def accepted_kwargs(function, kwargs: dict) -> dict:
    """The subset of ``kwargs`` that ``function`` accepts by name (all of them if it takes ``**kwargs``)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(kwargs)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {key: value for key, value in kwargs.items() if key in names}


def is_hf_model(module: nn.Module) -> TypeGuard[transformers.PreTrainedModel]:
    return isinstance(module, transformers.PreTrainedModel)


def trainer_sums_loss_terms() -> bool:
    """Whether upstream's trainer takes a loss that returns its terms by name, sums them and logs each
    (``track_loss_components``, which 4.x's trainer lacks)."""
    return hasattr(sentence_transformers.SentenceTransformerTrainer, "track_loss_components")


def is_gradient_caching(loss: Any) -> bool:
    """Whether ``loss`` runs its own backward passes (GradCache hook, or per-mini-batch backward in forward):
    nothing that only watches its forward pass sees the work that produces its gradients.

    6.x marks such losses with ``uses_gradient_cache``; older releases' are recognised by class.
    """
    if getattr(loss, "uses_gradient_cache", False):
        return True
    names = (
        "CachedMultipleNegativesRankingLoss",
        "CachedMultipleNegativesSymmetricRankingLoss",
        "CachedGISTEmbedLoss",
    )
    if isinstance(loss, tuple(filter(None, map(upstream_loss_class, names)))):
        return True
    cross_encoder = archetype_loss_class("cross_encoder", "CachedMultipleNegativesRankingLoss")
    if cross_encoder is not None and isinstance(loss, cross_encoder):
        return True
    return getattr(getattr(loss, "forward", None), "__name__", "") == "forward_mini_batched"


def upstream_loss_class(name: str) -> type[nn.Module] | None:
    """Upstream's loss class ``name``, or None where the installed release lacks it (4.1: ``DistillKLDivLoss``)."""
    return getattr(st_losses(), name, None)


def ranking_directions(loss: Any) -> tuple[str, ...] | None:
    """The ``directions`` a MultipleNegativesRankingLoss scores, or None where the installed release has no such
    option (4.x scores queries against documents only)."""
    directions = getattr(loss, "directions", None)
    return None if directions is None else tuple(directions)


def archetype_loss_class(archetype: str, name: str) -> type | None:
    """Upstream's loss class ``name`` of ``archetype`` (``"cross_encoder"``, ``"sparse_encoder"``,
    ``"multi_vector_encoder"``), or None where the installed release lacks either."""
    try:
        module = importlib.import_module(f"sentence_transformers.{archetype}.losses")
    except ImportError:
        return None
    return getattr(module, name, None)


def cross_encoder_scores_features(loss_class: type[nn.Module]) -> bool:
    """Whether CrossEncoder's cached ranking loss tokenizes its pairs with the model's ``preprocess`` (with a
    prompt and task) and reads ``model(features)["scores"]`` (6.x); 4.x's calls the Hugging Face classifier
    inside the loss, on raw pairs."""
    return "prompt" in inspect.signature(getattr(loss_class, "predict_minibatch")).parameters


def splade_component_values(loss: Any) -> dict[str, float]:
    """What ``CachedSpladeLoss.calculate_loss`` recorded of each term of its last loss, for the trainer's logs."""
    return dict(getattr(loss, "_component_values", {}))


def upstream_cached_loss_mixin() -> type | None:
    """Upstream's shared GradCache base ``CachedLossMixin`` (5.7+; its ``calculate_loss`` also takes the labels)."""
    try:
        from sentence_transformers.base.losses.gradcache import CachedLossMixin
    except ImportError:
        return None
    return CachedLossMixin


class AdaptiveLayerRules:
    """How the installed ``AdaptiveLayerLoss`` picks, weighs and distils its prior layers."""

    #: The hidden-state index of the layer upstream numbers 0 (1 before 5.2: the embedding output is skipped).
    first_hidden_state = 1 if ST_VERSION < Version("5.2.0") else 0
    #: Whether the final layer's KL target is detached (5.7+), or also receives the KL gradient.
    detached_teacher = ST_VERSION >= Version("5.7.0")

    @staticmethod
    def prior_layer_weight(loss: nn.Module, index: int) -> float:
        """The weight of upstream's prior layer ``index`` (``layer_weighting`` from 5.7, ``1 / (1 + index)`` before)."""
        get_layer_weight = getattr(loss, "get_layer_weight", None)
        return get_layer_weight(index) if get_layer_weight is not None else 1.0 / (1 + index)


def upstream_triplet_distance(name: str) -> Callable[[Tensor], Tensor] | None:
    """Upstream's ``BatchHardTripletLossDistanceFunction.<name>``, or None where the installed release lacks it
    (``euclidean_distance`` is newer than the misspelled ``eucledian_distance``)."""
    return getattr(st_losses().BatchHardTripletLossDistanceFunction, name, None)


def has_accelerate_hook(module: nn.Module) -> bool:
    """Whether accelerate's dispatch hooked ``module`` (``_hf_hook``, or the ``_old_forward`` it keeps)."""
    return hasattr(module, "_hf_hook") or hasattr(module, "_old_forward")


def clear_placement_cache(module: nn.Module) -> None:
    """Make ``module`` forget the accelerate placement hook sentence-transformers 6 caches on it; older ones cache none."""
    clear = getattr(module, "clear_placement_cache", None)
    if callable(clear):
        clear()


def profiler_cpu_memory_events(prof: Any) -> list[tuple[int, int]]:
    """(timestamp in ns, signed bytes) of every CPU allocation and free a stopped ``torch.profiler.profile``
    recorded with ``profile_memory=True``: only its private kineto results time each one, which a peak needs."""
    events = []
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU:
            events.append((event.start_ns(), event.nbytes()))
    return events


def unwrapped_model(model: nn.Module) -> nn.Module:
    """The sentence-transformers model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers.
    A ``CrossEncoder`` is an ``nn.Sequential`` from 5.4 on; before, the walk stops at it because it has neither
    attribute (it holds its Hugging Face classifier in ``.model``)."""
    while not isinstance(model, nn.Sequential):
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def loss_model(loss: nn.Module) -> nn.Module | None:
    """The model a loss embeds with (upstream's triplet losses call it ``sentence_embedder``)."""
    model = getattr(loss, "model", None)
    return getattr(loss, "sentence_embedder", None) if model is None else model


def compiled_module(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its private ``_orig_mod``), however often; else ``model``."""
    inner = getattr(model, "_orig_mod", None)
    while isinstance(inner, nn.Module):
        model = inner
        inner = getattr(model, "_orig_mod", None)
    return model


@functools.cache
def _fsdp2_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def is_fsdp2_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` turned ``module`` into an ``FSDPModule`` (FSDP2); False on a torch without it."""
    fsdp_module = _fsdp2_module_class()
    return fsdp_module is not None and isinstance(module, fsdp_module)


def all_gather_with_grad() -> Callable[[Tensor], Tensor] | None:
    """sentence-transformers' differentiable all-gather, or None where the installed release lacks it."""
    return getattr(st_util, "all_gather_with_grad", None)


def get_rank() -> int:
    """This process's rank, 0 when not running distributed (as upstream's ``util.get_rank``, which 4.x lacks)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def separate_column_forwards():
    """A context in which upstream's non-cached losses embed each input column in its own forward pass.

    6.x merges columns into one forward pass when they preprocess alike; the loss is the same, but
    dropout draws differ from one forward per column, the order cached losses replay.
    """
    try:
        from sentence_transformers.base.losses.merged_forward import column_merging_disabled
    except ImportError:
        return nullcontext()
    return column_merging_disabled()


# ----------------------------------------------------------------- private attributes of torch and others
# A module's own registries (not its submodules'), editable in place.


def own_parameters(module: nn.Module) -> dict:
    return module._parameters


def own_buffers(module: nn.Module) -> dict:
    return module._buffers


def own_submodules(module: nn.Module) -> dict:
    return module._modules


def fsdp_hook_dicts(module: nn.Module) -> list[dict]:
    """The hook dictionaries FSDP2 registers in, by what they would undo or run while a model saves."""
    return [module._forward_pre_hooks, module._forward_hooks, module._state_dict_pre_hooks]


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers that its ``state_dict`` leaves out."""
    return module._non_persistent_buffers_set


def recorded_name_or_path(config: Any) -> str | None:
    """Where a Hugging Face config says its model was loaded from (its private ``_name_or_path``)."""
    return getattr(config, "_name_or_path", None)


def parser_option(parser: Any, option_string: str) -> Any:
    """The ``argparse`` action registered for ``option_string`` (``--mini-batch-size``), to adjust it in place."""
    return parser._option_string_actions[option_string]


def ddp_static_graph_first_iteration(model: Any) -> bool:
    """Whether a static-graph DDP model has yet to finish its first iteration (which reduces despite ``no_sync``)."""
    return getattr(model, "static_graph", False) and not getattr(model, "_static_graph_delay_allreduce_enqueued", True)


def ddp_reduces_in_backward(model: Any) -> AbstractContextManager[None]:
    """Inside the block, DDP ``model``'s backward passes reduce gradients even inside an outer ``no_sync``: sets
    ``require_backward_grad_sync``, the flag ``DistributedDataParallel.no_sync`` clears (torch 2.x)."""
    return entries_set(vars(model), {"require_backward_grad_sync": True})


def ddp_skips_forward_buffer_broadcast(model: Any) -> AbstractContextManager[None]:
    """Inside the block, DDP ``model``'s forward passes skip the buffer broadcast that precedes them: clears
    ``require_forward_param_sync``, the flag ``DistributedDataParallel.forward`` reads (torch 2.x)."""
    return entries_set(vars(model), {"require_forward_param_sync": False})


def fsdp2_resharded_after_backward_only(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module that keeps its parameters gathered after forward
    (``reshard_after_forward=False``) and reshards them after backward. FSDP2 has setters for both and no
    getters, so this reads its private parameter group's ``post_forward_mesh_info`` (None when it keeps them)
    and ``reshard_after_backward`` (torch 2.x FSDP2, as of 2.13); where a torch release lacks them, the answer
    is False."""
    if not is_fsdp2_module(module):
        return False
    group = getattr(getattr(module, "_get_fsdp_state")(), "_fsdp_param_group", None)
    return getattr(group, "post_forward_mesh_info", False) is None and getattr(group, "reshard_after_backward", False)


def is_fsdp2_hook(hook: Any) -> bool:
    """Whether FSDP2 registered module hook ``hook``: FSDP2 has no registry of its hooks, so this reads where the
    function (or the ``functools.partial``'s) is defined, ``torch.distributed.fsdp`` (torch 2.x, as of 2.13)."""
    function = getattr(hook, "func", hook)
    return (getattr(function, "__module__", None) or "").startswith("torch.distributed.fsdp")


#: The attributes by which wrappers hold the module they wrap: activation checkpointing's (torch's
#: ``checkpoint_wrapper``, which accelerate's ``fsdp_activation_checkpointing`` applies) and ``torch.compile``'s.
_WRAPPED_MODULE_ATTRIBUTES = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def state_dict_key_prefix(module_name: str) -> str:
    """The prefix of the keys under which ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` (and
    ``state_dict()``) name the tensors of the submodule ``module_name`` (as ``named_modules`` names it): its path
    without the wrappers' own attributes, which both leave out (torch 2.x, as of 2.13)."""
    return "".join(f"{part}." for part in module_name.split(".") if part and part not in _WRAPPED_MODULE_ATTRIBUTES)


#: The first DeepSpeed release whose ZeRO hooks read ``ds_grad_is_ready`` (st_ext holds reductions with it).
DEEPSPEED_HOLDS_REDUCTION = Version("0.17.0")


@contextmanager
def deepspeed_gradients_ready(parameters: Iterable[Tensor], ready: bool) -> Iterator[None]:
    """Inside the block, DeepSpeed ZeRO queues the gradients of ``parameters`` for reduction only if ``ready``;
    otherwise they accumulate in ``.grad``. Sets the attribute ``ds_grad_is_ready`` that ZeRO's gradient hooks
    read on each parameter (DeepSpeed 0.17 on, :data:`DEEPSPEED_HOLDS_REDUCTION`; older releases ignore it)."""
    with ExitStack() as stack:
        for param in parameters:
            stack.enter_context(entries_set(vars(param), {"ds_grad_is_ready": ready}))
        yield


def partitioned_by_deepspeed(param: Tensor) -> bool:
    """Whether ``deepspeed.zero.Init`` split ``param`` across ranks: it gives each such parameter a ``ds_id``
    (DeepSpeed ZeRO-3, as of 0.19)."""
    return hasattr(param, "ds_id")


def training_deepspeed_config(args: Any) -> Any:
    """The DeepSpeed configuration of training arguments built with ``deepspeed=``, or None: the
    ``HfTrainerDeepSpeedConfig`` that transformers' ``TrainingArguments`` keeps in ``hf_deepspeed_config``
    (transformers 4.51 … 5.x), whose ``get_value``/``is_true``/``is_zero3`` st_ext reads."""
    return getattr(args, "hf_deepspeed_config", None)


def live_deepspeed_config() -> dict | None:
    """The DeepSpeed configuration (a dict) of the training arguments alive in this process, or None:
    transformers keeps the last one process-wide for ``from_pretrained`` (``transformers.integrations.deepspeed
    .deepspeed_config``, transformers 4.51 … 5.x)."""
    from transformers.integrations.deepspeed import deepspeed_config

    return deepspeed_config()


def deepspeed_version() -> Version | None:
    """The installed DeepSpeed's version (read without importing it), or None."""
    try:
        return Version(importlib.metadata.version("deepspeed"))
    except importlib.metadata.PackageNotFoundError:
        return None


#: Private methods of upstream classes that st_ext's subclasses override, and why no public hook serves.
PRIVATE_METHODS_OVERRIDDEN = {
    "_save": "the Trainer hands the whole state dict it gathered under FSDP2 to ``_save`` only",
    "_format_action_invocation": "argparse's help formatter names an option's flags only there",
}


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option of ``parser`` (argparse keeps them in its private ``_actions``; no public accessor lists
    them with their help)."""
    return parser._actions


def can_swap_parameter_data(param: Tensor, data: Tensor) -> bool:
    """Whether ``param.data = data`` works (torch refuses it across tensor types, e.g. from CPU to ``meta``)."""
    return torch._has_compatible_shallow_copy_type(param, data)


#: nn.Module's hook dictionaries, and the flag dictionaries keyed by hook id kept beside them.
_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_MODULE_HOOK_FLAG_DICTS = (
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)


def clear_module_hooks(module: nn.Module) -> int:
    """Empty the hook dictionaries of ``module`` itself (not its submodules); how many hooks it had."""
    removed = 0
    for attribute in _MODULE_HOOK_DICTS + _MODULE_HOOK_FLAG_DICTS:
        hooks = getattr(module, attribute, None)
        if isinstance(hooks, dict):
            removed += len(hooks) if attribute in _MODULE_HOOK_DICTS else 0
            hooks.clear()
    return removed


def autograd_node_tensors(node: Any) -> list[Tensor]:
    """Tensors an autograd node holds: AccumulateGrad's ``variable``, built-in nodes' ``_saved_*``, custom
    ``autograd.Function`` nodes' ``saved_tensors`` (e.g. checkpointing)."""
    variable = getattr(node, "variable", None)
    found = [variable] if isinstance(variable, Tensor) else []
    for attribute in dir(node):
        if not attribute.startswith("_saved_") and attribute != "saved_tensors":
            continue
        try:
            value = getattr(node, attribute)
        except RuntimeError:  # freed by a backward pass already
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        found += [item for item in values if isinstance(item, Tensor)]
    return found


def _st_evaluation() -> ModuleType:
    """The evaluators' namespace for SentenceTransformer models (newer releases moved it; the old path warns)."""
    try:
        return importlib.import_module("sentence_transformers.sentence_transformer.evaluation")
    except ImportError:
        return importlib.import_module("sentence_transformers.evaluation")


def information_retrieval_evaluator() -> type:
    """Upstream ``InformationRetrievalEvaluator``."""
    return _st_evaluation().InformationRetrievalEvaluator


def sequential_evaluator() -> type:
    """Upstream ``SequentialEvaluator``."""
    return _st_evaluation().SequentialEvaluator
