"""Training under torch.distributed: 2 ranks on the CPU (gloo), launched with torchrun.

Launches of ``tests/distributed_worker.py``, one per mode (and per ZeRO stage or frozen-encoder mode):

* ``losses``: one manual DDP step per loss case; the ranks save what they computed and each test
  compares it with a single process computing the same step here. Which single-process step a DDP
  step equals is explained in the worker's docstring: the mean of per-rank steps when in-batch
  negatives stay on their rank, the step over the concatenated batch with gather_across_devices.
* ``deepspeed``: the same steps under a DeepSpeed engine at each ZeRO stage, and the auto mini-batch.
* ``train``: an ordinary st_ext training script, unchanged, under torchrun.
* ``deepspeed-train``, ``deepspeed-guide``: training scripts with the Trainer's ``deepspeed`` argument;
  the second loads its GIST guide after ZeRO-3 arguments, which partition it.
* ``fsdp2-train``: the unchanged script under FSDP2, set by the example accelerate config or by the
  Trainer's ``fsdp`` arguments.

The model's dropout is 0 (in its config), so a step is a deterministic function of the weights and
the batch, and the comparisons hold to float32 round-off.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
import transformers
from packaging.version import Version
from tiny_models import save_tiny_bert

pytestmark = pytest.mark.distributed

WORKER = Path(worker.__file__)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: transformers 5 builds FSDP2 from the Trainer's ``fsdp`` arguments (its default version); 4.51's give
#: FSDP1, and FSDP2 there comes from an accelerate config.
TRAINER_ARGUMENTS_GIVE_FSDP2 = Version(transformers.__version__).major >= 5
LAUNCH_TIMEOUT_S = 600
LOSS_CASES = sorted(worker.CASES)
GATHER_CASES = [name for name in LOSS_CASES if worker.CASES[name].gathered]
#: The LoRA decoder's cases under ZeRO take their own DeepSpeed launch (about a minute on 2 cores): slow.
DEEPSPEED_CASES = [
    pytest.param(name, marks=pytest.mark.slow) if worker.CASES[name].lora_decoder else name for name in LOSS_CASES
]
MARKED_TWICE_ERROR = "marked as ready twice"
UNFINISHED_REDUCTION_ERROR = "Expected to have finished reduction in the prior iteration"


# ---------------------------------------------------------------------------------------------
# Launching


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker_environment() -> dict[str, str]:
    """Offline, CPU only (also on a GPU machine, so results do not depend on it), one thread per rank."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
        DS_ACCELERATOR="cpu",
    )  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun(*worker_args: str, log: Path, environment: dict[str, str] | None = None) -> None:
    """Run the worker on 2 ranks, with ``environment`` added to :func:`worker_environment`; fail with the
    end of its output if any rank fails or it hangs."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc_per_node", str(worker.WORLD_SIZE),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(WORKER), *worker_args,
    ]  # fmt: skip
    with log.open("w") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**worker_environment(), **(environment or {})},
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    if returncode != 0:
        outcome = "timed out (a rank waiting in a collective?)" if returncode is None else f"exited {returncode}"
        pytest.fail(f"torchrun {outcome}; end of its output:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """The model to train (dropout 0), a different frozen guide, and a CrossEncoder classifier."""
    root = tmp_path_factory.mktemp("distributed_models")
    return {
        "model": save_tiny_bert(root / "model", dropout=0.0),
        "guide": save_tiny_bert(root / "guide", dropout=0.0, seed=1),
        "classifier": save_tiny_bert(root / "classifier", classifier=True),
    }


@pytest.fixture(scope="module")
def loss_run(model_dirs, tmp_path_factory) -> Path:
    """The directory where both ranks saved every available loss case and the two failure cases."""
    out = tmp_path_factory.mktemp("distributed_losses")
    cases = [name for name in LOSS_CASES if worker.CASES[name].available()]
    torchrun(
        "losses", "--model", str(model_dirs["model"]), "--guide", str(model_dirs["guide"]), "--out", str(out), *cases,
        log=out / "torchrun.log",
    )  # fmt: skip
    return out


def deepspeed_run_of(model_dirs, out: Path, lora_decoder: bool) -> Path:
    """Both ranks' every available loss case under each ZeRO stage, of the LoRA decoder or of the tiny BERT."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is a test extra (requirements/test.txt)")
    cases = [
        name
        for name in LOSS_CASES
        if worker.CASES[name].available() and worker.CASES[name].lora_decoder == lora_decoder
    ]
    torchrun(
        "deepspeed", "--model", str(model_dirs["model"]), "--guide", str(model_dirs["guide"]), "--out", str(out),
        *cases, log=out / "torchrun.log",
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def deepspeed_loss_run(model_dirs, tmp_path_factory) -> Path:
    """The directory where both ranks saved every available loss case of the tiny BERT under each ZeRO stage."""
    return deepspeed_run_of(model_dirs, tmp_path_factory.mktemp("deepspeed_losses"), lora_decoder=False)


@pytest.fixture(scope="module")
def deepspeed_lora_run(model_dirs, tmp_path_factory) -> Path:
    """The same for the LoRA decoder's cases."""
    return deepspeed_run_of(model_dirs, tmp_path_factory.mktemp("deepspeed_lora_losses"), lora_decoder=True)


@pytest.fixture(scope="module", params=worker.ZERO_STAGES, ids=lambda stage: f"zero{stage}")
def deepspeed_training(request, model_dirs, tmp_path_factory) -> tuple[int, Path]:
    """The ZeRO stage, and the directory where the training script saved its reports and model under it."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is a test extra (requirements/test.txt)")
    out = tmp_path_factory.mktemp(f"deepspeed_training_zero{request.param}")
    torchrun(
        "deepspeed-train", "--model", str(model_dirs["model"]), "--out", str(out), "--stage", str(request.param),
        log=out / "torchrun.log",
    )  # fmt: skip
    return request.param, out


@pytest.fixture(scope="module")
def single_process_training(model_dirs, tmp_path_factory) -> Path:
    """Where the same training script, run here in one process, saved its model."""
    out = tmp_path_factory.mktemp("single_process_training")
    worker.train_sentence_transformer(model_dirs["model"], out, ddp_backend=None)  # no process group here
    return out / "final"


@pytest.fixture(scope="module")
def trainer_run(model_dirs, tmp_path_factory) -> Path:
    """Where the unchanged training scripts, run under DDP, saved their reports and models."""
    out = tmp_path_factory.mktemp("distributed_trainers")
    torchrun(
        "train", "--model", str(model_dirs["model"]), "--classifier", str(model_dirs["classifier"]), "--out", str(out),
        log=out / "torchrun.log",
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def trainer_reports(trainer_run) -> list[dict]:
    """Each rank's report of the unchanged training scripts, rank 0 first."""
    return rank_reports(trainer_run, "train")


def accelerate_launch_environment(config: Path) -> dict[str, str]:
    """The environment ``accelerate launch --config_file config`` gives each process, derived by
    accelerate's own launcher, with mixed precision off: the comparison with DDP's training holds to
    float32 round-off only in float32."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    launch_args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    launch_args, _, _ = _validate_launch_command(launch_args)
    environment = prepare_multi_gpu_env(launch_args)
    derived = {key: value for key, value in environment.items() if key.startswith(("ACCELERATE_", "FSDP_"))}
    return {**derived, "ACCELERATE_MIXED_PRECISION": "no"}


@pytest.fixture(scope="module", params=worker.FSDP2_ROUTES)
def fsdp2_training(request, model_dirs, tmp_path_factory) -> tuple[str, Path]:
    """How FSDP2 was set, and where the unchanged script saved its reports and model under it."""
    route = request.param
    if route == "trainer-arguments" and not TRAINER_ARGUMENTS_GIVE_FSDP2:
        pytest.skip(f"transformers {transformers.__version__}'s fsdp arguments give FSDP1, not FSDP2")
    out = tmp_path_factory.mktemp(f"fsdp2_{route}")
    environment = None
    if route == "accelerate-config":
        environment = accelerate_launch_environment(EXAMPLES / "accelerate_fsdp2.yaml")
    torchrun(
        "fsdp2-train", "--model", str(model_dirs["model"]), "--out", str(out), "--route", route,
        log=out / "torchrun.log", environment=environment,
    )  # fmt: skip
    return route, out


def rank_results(out: Path, name: str) -> list:
    return [torch.load(out / f"{name}-rank{rank}.pt", weights_only=False) for rank in range(worker.WORLD_SIZE)]


def rank_reports(out: Path, name: str) -> list[dict]:
    """Each rank's report of a training script (``save_report_and_close``), rank 0 first."""
    return [json.loads((out / f"{name}-rank{rank}.json").read_text()) for rank in range(worker.WORLD_SIZE)]


# ---------------------------------------------------------------------------------------------
# Comparisons


def weights(path: Path) -> dict:
    """The parameters of the model saved at ``path``, as plain sentence-transformers loads them."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return {name: p.detach() for name, p in model.named_parameters()}


def assert_close_tensors(actual: dict, expected: dict, what: str) -> None:
    """Same names, and values equal up to float32 round-off relative to the largest entry."""
    assert actual.keys() == expected.keys(), f"{what}: different parameters"
    scale = max(value.abs().max().item() for value in expected.values())
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-5 * scale, msg=f"{what}: {name}")


def assert_same_step(ranks: list[dict], reference: dict, gathered: bool, step: int) -> None:
    """One DDP step against its single-process reference: losses, averaged gradients, updated weights."""
    for rank, result in enumerate(ranks):
        assert_close_tensors(result["grads"], reference["grads"], f"step {step}, rank {rank} gradients")
        assert_close_tensors(result["params"], reference["params"], f"step {step}, rank {rank} parameters")
    rank_losses = torch.tensor([result["loss"] for result in ranks])
    if gathered:
        # Each rank's loss is the mean over its anchors; their mean is the concatenated batch's loss.
        torch.testing.assert_close(rank_losses.mean(), torch.tensor(reference["loss"]), rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(rank_losses, torch.tensor(reference["rank_losses"]), rtol=1e-5, atol=1e-6)
    for queue in ("memory", "query_memory"):
        if reference.get(queue) is not None:
            for result in ranks:
                torch.testing.assert_close(result[queue], reference[queue], rtol=1e-4, atol=1e-6)


def require_available(name: str) -> None:
    reason = worker.CASES[name].unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


# ---------------------------------------------------------------------------------------------
# Loss equality under DDP


@pytest.mark.parametrize("name", LOSS_CASES)
def test_ddp_step_matches_single_process(name, loss_run, model_dirs):
    """The DDP-averaged gradient and update equal the single-process step the case stands for."""
    require_available(name)
    ranks = rank_results(loss_run, name)
    reference = worker.single_process_run(name, model_dirs["model"], model_dirs["guide"])
    assert len(reference) == worker.CASES[name].steps
    for step, expected in enumerate(reference):
        step_ranks = [steps[step] for steps in ranks]
        # DDP invariant: every rank holds the same averaged gradient, so the replicas stay identical.
        assert_close_tensors(step_ranks[1]["grads"], step_ranks[0]["grads"], f"step {step}, rank 1 vs rank 0")
        assert_same_step(step_ranks, expected, worker.CASES[name].gathered, step)


@pytest.mark.parametrize("resharding", worker.FSDP2_RESHARDING)
@pytest.mark.parametrize("name", LOSS_CASES)
def test_fsdp2_step_matches_single_process(name, resharding, loss_run, model_dirs):
    """With the model sharded by FSDP2 (``fully_shard`` per layer and on the model), the cached losses'
    per-mini-batch replay gives the gradients and update of the same single-process step, whether the
    modules reshard after forward (FSDP2's default) or stay gathered (``reshard_after_forward=False``)."""
    require_available(name)
    if not worker.fsdp2_available():
        pytest.skip(f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    ranks = rank_results(loss_run, f"{name}-fsdp2-{resharding}")
    reference = worker.single_process_run(name, model_dirs["model"], model_dirs["guide"])
    for step, expected in enumerate(reference):
        assert_same_step([steps[step] for steps in ranks], expected, worker.CASES[name].gathered, step)
        # Held until the last mini-batch: no pass of the step starts with reduced (sharded) gradients,
        # and each module that owns trained weights reduce-scatters once in the step.
        record = ranks[0][step]
        assert not any(record["reduced_before_pass"]), "a mini-batch reduced before the last"
        assert record["reduce_scatters"] == record["reducing_modules"]
        if resharding == "kept_gathered":
            # Each module gathered once for the whole step, not once per mini-batch pass.
            assert record["all_gathers"] == record["sharded_modules"]


@pytest.mark.parametrize("stage", worker.ZERO_STAGES)
@pytest.mark.parametrize("name", DEEPSPEED_CASES)
def test_deepspeed_step_matches_single_process(name, stage, request, model_dirs):
    """Under a DeepSpeed engine at each ZeRO stage, the cached losses' per-mini-batch replay trains
    instead of failing ("Gradient computed twice for this partition" at stages 2 and 3), and gives the
    gradients and update of the same single-process step."""
    require_available(name)
    run = request.getfixturevalue("deepspeed_lora_run" if worker.CASES[name].lora_decoder else "deepspeed_loss_run")
    ranks = rank_results(run, f"{name}-zero{stage}")
    reference = worker.single_process_run(name, model_dirs["model"], model_dirs["guide"])
    for step, expected in enumerate(reference):
        step_ranks = [without_unused_zeros(steps[step], expected) for steps in ranks]
        assert_same_step(step_ranks, expected, worker.CASES[name].gathered, step)


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_auto_mini_batch_measures_without_reducing(stage, deepspeed_loss_run, model_dirs):
    """Under ZeRO 1 and 2, mini_batch_size="auto" probes each rank's memory with backward passes that
    reduce nothing, chooses mini-batches smaller than the rank's batch, and trains the same step."""
    reference = worker.single_process_run("matryoshka_cmnrl", model_dirs["model"], model_dirs["guide"])[0]
    ranks = rank_results(deepspeed_loss_run, f"auto-zero{stage}")
    for rank, result in enumerate(ranks):
        assert result["error"] is None, result["error"]
        assert result["size"] < worker.ROWS_PER_RANK * len(worker.COLUMNS), f"rank {rank} took the whole batch"
        assert_close_tensors(without_unused_zeros(result, reference)["grads"], reference["grads"], f"rank {rank}")
    torch.testing.assert_close(torch.tensor([r["loss"] for r in ranks]), torch.tensor(reference["rank_losses"]))


def test_deepspeed_zero3_refuses_auto_mini_batch(deepspeed_loss_run):
    """Under ZeRO-3 each forward pass gathers parameters, a collective a rank cannot run alone to measure
    itself: the auto mode says so and asks for a fixed size, instead of leaving ranks waiting on each other."""
    for result in rank_results(deepspeed_loss_run, "auto-zero3"):
        assert result["error"] is not None and "Set a fixed mini_batch_size" in result["error"], result["error"]


def without_unused_zeros(result: dict, reference: dict) -> dict:
    """DeepSpeed keeps gradients in flat buffers, so a parameter the loss never uses (BERT's pooler)
    reads zeros where a plain step leaves None; those must be zeros, and are then left out."""
    unused = result["grads"].keys() - reference["grads"].keys()
    for name in unused:
        assert not result["grads"][name].any(), f"{name}: unused by the loss, yet a non-zero gradient"
    return {**result, "grads": {name: grad for name, grad in result["grads"].items() if name not in unused}}


def test_lora_decoder_trains_only_its_adapter(loss_run):
    """The LoRA decoder's DDP steps, which the comparisons above check, reduce gradients of the adapter's weights
    only, all of them, and leave every base weight as it was."""
    require_available("lora_decoder_matryoshka_cmnrl")
    start = {name: p.detach() for name, p in worker.lora_decoder().named_parameters()}
    for result in rank_results(loss_run, "lora_decoder_matryoshka_cmnrl")[0]:
        adapter = {name for name in start if "lora_" in name}
        assert adapter and result["grads"].keys() == adapter
        assert all(grad.abs().sum() > 0 for grad in result["grads"].values())
        for name, value in start.items():
            if name not in adapter:
                torch.testing.assert_close(result["params"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", GATHER_CASES)
def test_gathering_changes_the_step(name, loss_run):
    """Gathered and per-rank negatives give different updates, so the comparisons above can tell them apart."""
    require_available(name)
    local_name = name.removesuffix("_gathered")
    gathered, local = rank_results(loss_run, name)[0][0], rank_results(loss_run, local_name)[0][0]
    differs = any(
        not torch.allclose(gathered["grads"][key], local["grads"][key], rtol=1e-3, atol=1e-6) for key in local["grads"]
    )
    assert differs, f"{name} and {local_name} produced the same gradients"


def test_memory_holds_every_ranks_documents(loss_run):
    """After a step each rank's queue holds the documents (positives and negatives) of both ranks."""
    documents_per_step = worker.WORLD_SIZE * worker.ROWS_PER_RANK * (len(worker.COLUMNS) - 1)
    for step, ranks in enumerate(zip(*rank_results(loss_run, "cross_batch_memory"))):
        assert [len(result["memory"]) for result in ranks] == [documents_per_step * (step + 1)] * worker.WORLD_SIZE
        torch.testing.assert_close(ranks[1]["memory"], ranks[0]["memory"], rtol=0, atol=0)


def test_query_bank_holds_every_ranks_anchors(loss_run):
    """After a step each rank's query bank holds the anchors of both ranks, in rank order."""
    require_available("cross_batch_memory_query_bank")
    for step, ranks in enumerate(zip(*rank_results(loss_run, "cross_batch_memory_query_bank"))):
        rows = worker.WORLD_SIZE * worker.ROWS_PER_RANK * (step + 1)
        assert [len(result["query_memory"]) for result in ranks] == [rows] * worker.WORLD_SIZE
        torch.testing.assert_close(ranks[1]["query_memory"], ranks[0]["query_memory"], rtol=0, atol=0)


def test_same_document_masking_reaches_across_ranks(loss_run, model_dirs):
    """The ranks' batches share documents, so the gathered step (equal to the concatenated batch's above)
    masks candidates gathered from the other rank; the masking changes the step."""
    require_available("matryoshka_same_document_gathered")
    model = worker.load_model(model_dirs["model"])
    shares = [worker.rank_share(worker.global_batch(0), rank) for rank in range(worker.WORLD_SIZE)]
    ids = [worker.first_word_of_positive(worker.features_of(model, share), None) for share in shares]
    assert set(ids[0].tolist()) & set(ids[1].tolist()), "no document on both ranks: the check proves nothing"
    masked = rank_results(loss_run, "matryoshka_same_document_gathered")[0][0]
    plain = rank_results(loss_run, "matryoshka_cmnrl_gathered")[0][0]
    assert any(
        not torch.allclose(masked["grads"][key], plain["grads"][key], rtol=1e-3, atol=1e-6) for key in plain["grads"]
    )


# ---------------------------------------------------------------------------------------------
# DDP settings that fail


def test_reentrant_checkpointing_fails_with_unused_parameter_detection(loss_run):
    """st_ext defaults to use_reentrant=False because the re-entrant variant breaks under DDP with
    find_unused_parameters=True, which the Trainer sets for every sentence-transformers model."""
    for result in rank_results(loss_run, "reentrant"):
        assert result["error"] is not None and MARKED_TWICE_ERROR in result["error"], result["error"]


def test_unused_parameter_detection_off_leaves_gradients_unaveraged(loss_run):
    """With ddp_find_unused_parameters=False, BERT's unused pooler stops DDP from averaging anything:
    the replicas' first update differs, and the second step raises."""
    first, second = rank_results(loss_run, "no-unused-detection")
    assert not torch.allclose(first["first_step_grad"], second["first_step_grad"])
    for result in (first, second):
        assert result["second_step_error"] is not None
        assert UNFINISHED_REDUCTION_ERROR in result["second_step_error"], result["second_step_error"]


# ---------------------------------------------------------------------------------------------
# The trainers, unchanged under torchrun


@pytest.mark.parametrize("trainer", ["sentence_transformer", "cross_encoder"])
def test_trainer_runs_under_torchrun_with_checkpointing(trainer, trainer_reports):
    """Both ranks finish max_steps under DDP with gradient checkpointing on, with identical weights.

    Upstream fails each of these somewhere in the supported range (see st_ext.training.ddp)."""
    errors = [rank[trainer]["error"] for rank in trainer_reports]
    assert errors == [None] * worker.WORLD_SIZE, errors
    reports = [rank[trainer]["report"] for rank in trainer_reports]
    for report in reports:
        assert report["world_size"] == worker.WORLD_SIZE
        assert report["wrapped_in"] == "DistributedDataParallel"
        # The Trainer's choice for models that are not a transformers PreTrainedModel.
        assert report["find_unused_parameters"] is True
        assert report["checkpointing"] is True
        assert report["global_step"] == 2
    assert reports[0]["digest"] == reports[1]["digest"], "the replicas' weights differ after training"


def test_trainer_trains_under_deepspeed_and_saves_a_plain_model(
    deepspeed_training, single_process_training, model_dirs
):
    """The unchanged script with the Trainer's ``deepspeed`` argument trains the cached Matryoshka loss
    with gradient checkpointing at each ZeRO stage; plain sentence-transformers loads what it saved, and
    the weights equal one process's training (see ``run_deepspeed_training`` for why one process's)."""
    stage, out = deepspeed_training
    runs = rank_reports(out, f"train-zero{stage}")
    for run in runs:
        assert run["error"] is None, run["error"]
        assert run["report"]["wrapped_in"] == "DeepSpeedEngine"
        # The premise of comparing with one process: accelerate, finding no backend, counted one.
        assert run["report"]["world_size"] == 1, "accelerate shards the data here: compare with the 2-rank step"
        assert run["report"]["global_step"] == 2
        assert run["report"]["checkpointing"] is True

    saved, expected, initial = (
        weights(out / f"zero{stage}" / "final"),
        weights(single_process_training),
        weights(model_dirs["model"]),
    )
    assert_close_tensors(saved, expected, f"ZeRO-{stage} trained weights")
    assert not all(torch.equal(saved[name], initial[name]) for name in initial), "training changed nothing"


def test_trainer_trains_under_fsdp2_and_saves_a_plain_model(fsdp2_training, trainer_run, model_dirs):
    """The unchanged script under FSDP2, set by the example accelerate config or by the Trainer's
    arguments, trains the cached Matryoshka loss with gradient checkpointing; plain sentence-transformers
    loads what it saved (a full state dict: upstream's save fails on the shards), and the weights
    equal the same script's training under DDP. accelerate shards FSDP only on GPUs, so the worker lets
    CPU ranks take its FSDP2 path (``let_accelerate_shard_on_cpu``)."""
    route, out = fsdp2_training
    runs = rank_reports(out, f"fsdp2-{route}")
    for run in runs:
        assert run["error"] is None, run["error"]
        assert run["report"]["distributed_type"] == "DistributedType.FSDP"
        assert run["report"]["wrapped_in"].startswith("FSDP"), "the model was not sharded by fully_shard"
        assert run["report"]["world_size"] == worker.WORLD_SIZE
        assert run["report"]["global_step"] == 2
        assert run["report"]["checkpointing"] is True
    assert runs[0]["report"]["digest"] == runs[1]["report"]["digest"]

    saved, expected = weights(out / route / "final"), weights(trainer_run / "st" / "final")
    initial = weights(model_dirs["model"])
    assert_close_tensors(saved, expected, f"FSDP2 ({route}) trained weights against DDP's")
    assert not all(torch.equal(saved[name], initial[name]) for name in initial), "training changed nothing"
    # Where upstream's model card shows its usage example's similarities (6.x), the saving rank alone
    # encoded them with the whole weights.
    if "# tensor([[" in (trainer_run / "st" / "final" / "README.md").read_text():
        assert "# tensor([[" in (out / route / "final" / "README.md").read_text()


@pytest.fixture(scope="module", params=["resident", "precompute"])
def guide_loaded_last(request, model_dirs, tmp_path_factory) -> tuple[str, Path]:
    """The frozen-encoder mode, and where the arguments-first GIST script saved its reports and model
    under ZeRO-3."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is a test extra (requirements/test.txt)")
    out = tmp_path_factory.mktemp(f"guide_loaded_last_{request.param}")
    torchrun(
        "deepspeed-guide", "--model", str(model_dirs["model"]), "--guide", str(model_dirs["guide"]), "--out", str(out),
        "--frozen-encoders", request.param, log=out / "torchrun.log",
    )  # fmt: skip
    return request.param, out


def test_guide_loaded_after_zero3_arguments_trains(guide_loaded_last, model_dirs, tmp_path):
    """A guide that ZeRO-3 partitioned while loading (it came after the arguments) gathers its weights on
    use, resident or for "precompute": the trained weights equal one process's training with the whole
    guide. Without st_ext its first pass fails ("'weight' must be 2-D")."""
    mode, out = guide_loaded_last
    runs = rank_reports(out, f"guide-{mode}")
    for run in runs:
        assert run["error"] is None, run["error"]
        assert run["guide_partitioned"] is True, "the guide was loaded whole: this checks nothing"
        assert run["report"]["world_size"] == 1  # as in the unchanged script's DeepSpeed test
        assert run["report"]["global_step"] == 2
    worker.train_with_guide_loaded_last(model_dirs["model"], model_dirs["guide"], tmp_path, mode, ddp_backend=None)
    saved, expected, initial = weights(out / mode / "final"), weights(tmp_path / "final"), weights(model_dirs["model"])
    assert_close_tensors(saved, expected, f"weights trained with a partitioned guide ({mode})")
    assert not all(torch.equal(saved[name], initial[name]) for name in initial), "training changed nothing"
    if mode == "resident":
        for run in runs:
            assert run["offload_error"] is not None and "sharded across ranks" in run["offload_error"]


# ---------------------------------------------------------------------------------------------
# Every archetype's upstream cached loss under every engine, with evaluation between the steps


def archetype_case_names() -> list[str]:
    from archetype_losses import CASES

    return [name for name, case in CASES.items() if case.missing() is None]


#: accelerate's FSDP2 preparation shards a model's last module named like a norm on its own; for a
#: MultiVectorEncoder that is upstream's ``Normalize``, whose class fully_shard cannot swap ("__class__
#: assignment: 'FSDPNormalize' object layout differs from 'Normalize'"): the model fails before any loss runs.
FSDP2_PREPARATION_FAILS = {"multi_vector_cmnrl"}


def archetype_cases_under(engine: str) -> list[str]:
    return [name for name in archetype_case_names() if engine != "fsdp2" or name not in FSDP2_PREPARATION_FAILS]


@pytest.fixture(scope="module")
def archetype_model_dirs(tmp_path_factory) -> dict[str, Path]:
    from archetype_losses import save_case_models

    return save_case_models(tmp_path_factory.mktemp("archetype_models"))


@pytest.fixture(scope="module", params=worker.ARCHETYPE_ENGINES)
def archetype_engine_run(request, archetype_model_dirs, tmp_path_factory) -> tuple[str, Path]:
    """The engine, and where both ranks saved each case's report and trained model under it."""
    engine = request.param
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is a test extra (requirements/test.txt)")
    out = tmp_path_factory.mktemp(f"archetypes_{engine}")
    environment = accelerate_launch_environment(EXAMPLES / "accelerate_fsdp2.yaml") if engine == "fsdp2" else None
    models = archetype_model_dirs["encoder"].parent
    torchrun(
        "archetype-engines", "--models", str(models), "--out", str(out), "--engine", engine, *archetype_cases_under(engine),
        log=out / "torchrun.log", environment=environment,
    )  # fmt: skip
    return engine, out


@pytest.fixture(scope="module")
def archetype_references(archetype_model_dirs, tmp_path_factory) -> dict[tuple[str, int], Path]:
    """One process's training of each case: over the two ranks' rows (gradient accumulation over each rank's
    batch, which DDP and FSDP2 average), and over one rank's rows (what DeepSpeed trains here: accelerate
    counts one process on CPU ranks, so each rank reads the whole dataset, see ``run_deepspeed_training``;
    for the same reason no eval loss there, see ``archetype_eval_loss``)."""
    out = tmp_path_factory.mktemp("archetype_references")
    runs = {}
    for name in archetype_case_names():
        for accumulation, engine in ((1, "zero1"), (2, "ddp")):
            trainer = worker.train_archetype(
                name, archetype_model_dirs, out / f"{name}-{accumulation}", ddp_backend=None,
                gradient_accumulation_steps=accumulation, eval_loss=worker.archetype_eval_loss(engine),
            )  # fmt: skip
            runs[name, accumulation] = (out / f"{name}-{accumulation}" / "final", worker.archetype_report(trainer))
    return runs


def archetype_weights(name: str, path: Path) -> dict:
    """The parameters of the model saved at ``path``, as plain sentence-transformers loads its archetype."""
    import sentence_transformers
    from archetype_losses import CASES

    model = getattr(sentence_transformers, CASES[name].archetype)(str(path), device="cpu")
    return {key: value.detach() for key, value in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", archetype_case_names())
def test_every_archetypes_upstream_cached_loss_trains_and_evaluates_as_one_process(
    name, archetype_engine_run, archetype_references, archetype_model_dirs
):
    """Upstream's cached loss object of each archetype, trained by st_ext's trainer on its engine under DDP,
    FSDP2 and ZeRO 1-3: the trained weights equal one process's, and so do the evaluations after each step
    (eval loss through the cached loss, not under DeepSpeed on CPU ranks, and the SentenceTransformer's
    information-retrieval metrics), the second step following the first evaluation. Under ZeRO-2/3 a second reduction within a step fails
    ("Gradient computed twice for this partition"), so these runs reduce once per step."""
    engine, out = archetype_engine_run
    if name not in archetype_cases_under(engine):
        pytest.skip(
            f"accelerate's FSDP2 preparation fails on this {name} model whatever the loss (FSDP2_PREPARATION_FAILS)"
        )
    runs = [rank[name] for rank in rank_reports(out, f"archetypes-{engine}")]
    for run in runs:
        assert run["report"] is not None, run.get("error")
        assert run["report"]["engine_forwards"] == 1, "st_ext's trainer did not forward the loss on its engine"
        assert run["report"]["global_step"] == 2
    deepspeed = engine.startswith("zero")
    if not deepspeed and not TRAINER_ARGUMENTS_GIVE_FSDP2:
        pytest.skip(
            "transformers 4's gradient accumulation sums the micro-batch losses (it logs twice their mean), so one "
            "process accumulating two batches is not the DDP average; test_ddp_step_matches_single_process covers 4.x"
        )
    path, reference = archetype_references[name, 1 if deepspeed else 2]
    for run in runs:
        assert run["report"]["wrapped_in"] == ("DeepSpeedEngine" if deepspeed else run["report"]["wrapped_in"])
        logged, expected = run["report"]["logged"], reference["logged"]
        assert [sorted(entry) for entry in logged] == [sorted(entry) for entry in expected]
        for entry, expected_entry in zip(logged, expected):
            assert entry == pytest.approx(expected_entry, rel=1e-4, abs=1e-5)
    assert runs[0]["report"]["digest"] == runs[1]["report"]["digest"]
    unsaved = out / name / worker.UNSAVED
    if unsaved.exists():  # a MultiVectorEncoder under ZeRO 1/2: upstream's Dense save fails (train_archetype)
        assert engine in ("zero1", "zero2") and name == "multi_vector_cmnrl", engine
        saved = torch.load(unsaved)
    else:
        saved = archetype_weights(name, out / name / "final")
    assert_close_tensors(saved, archetype_weights(name, path), f"{engine} {name} trained weights")
