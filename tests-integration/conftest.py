"""Fixtures for tests that run the real `lm-train` command in subprocesses on a tiny corpus of their own."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

LM_TRAIN = [sys.executable, "-m", "lm_train"]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess with `devices` CPU devices, compiling at the session's LLVM level.

    The root conftest compiles at -O0 (half the CPU time of a tiny step's compile); a process that sets its own
    device count keeps that level, so that its floats compare bitwise with the session's other runs."""
    level = [FAST_COMPILE_FLAG] if FAST_COMPILE_FLAG in os.environ.get("XLA_FLAGS", "") else []
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *level])


CLI_TIMINGS: list[tuple[str, float, int]] = []
"""(command, seconds, exit code) of every `lm-train` subprocess of the session: the summary lists the errors'."""


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    umask: int = -1,
    prefix: tuple[str, ...] = (),
) -> CliResult:
    """Run `lm-train ARGS` in a fresh interpreter (with `umask`, if given; under the command `prefix`, if given);
    the result carries both output streams."""
    full_env = dict(os.environ)
    full_env.setdefault("XLA_FLAGS", xla_flags(8))
    full_env.update(env or {})
    start = time.perf_counter()
    done = subprocess.run(
        [*prefix, *LM_TRAIN, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout, umask=umask
    )
    CLI_TIMINGS.append((" ".join(args), time.perf_counter() - start, done.returncode))
    return CliResult(done.returncode, done.stdout, done.stderr)


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its timings to the controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["lm_train_timings"] = json.dumps(CLI_TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's hook on the controller: a worker has finished; keep its `lm-train` timings."""
    CLI_TIMINGS.extend(tuple(row) for row in json.loads(node.workeroutput.get("lm_train_timings", "[]")))


def pytest_terminal_summary(terminalreporter):
    """How long each `lm-train` call that ended in a clear error (exit 2) took: config errors must be quick."""
    errors = [(command, seconds) for command, seconds, code in CLI_TIMINGS if code == 2]
    if not errors:
        return
    terminalreporter.section("lm-train: time to a clear error (exit code 2)")
    for command, seconds in sorted(errors, key=lambda e: -e[1]):
        terminalreporter.write_line(f"{seconds:6.2f} s  lm-train {command[:110]}")


@pytest.fixture(scope="session")
def cli():
    """The function that runs `lm-train ARGS` in a subprocess."""
    return run_cli


@pytest.fixture(scope="session")
def lm_train_command() -> list[str]:
    """The argv prefix that starts `lm-train` with this interpreter."""
    return list(LM_TRAIN)


# Root reads any file whatever its mode; without these two capabilities it obeys the permission bits.
WITHOUT_FILE_ACCESS_OVERRIDE = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")


@pytest.fixture(scope="session")
def cli_obeying_file_modes(tmp_path_factory):
    """`cli`, but the command cannot read a file whose mode forbids it, even as root (skipped where that cannot be
    arranged): what a file without read permission does to a user."""
    probe_file = tmp_path_factory.mktemp("probe") / "mode-000"
    probe_file.write_text("x")
    probe_file.chmod(0)
    if os.geteuid() != 0:
        return run_cli
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing, so root cannot be kept from reading a mode-000 file")
    if subprocess.run([*WITHOUT_FILE_ACCESS_OVERRIDE, "cat", str(probe_file)], capture_output=True).returncode == 0:
        pytest.skip("this process reads a mode-000 file even without CAP_DAC_OVERRIDE (not a permission test)")
    return lambda args, cwd, **kw: run_cli(args, cwd, prefix=WITHOUT_FILE_ACCESS_OVERRIDE, **kw)


TINY_MODEL = """\
model:
  type: gpt2
  seq_len: 32
  hidden_dim: 32
  num_heads: 2
  num_layers: 2
  gradient_checkpointing: false
"""


@pytest.fixture(scope="session")
def tiny_model_yaml() -> str:
    """The `model:` section of the tiny GPT-2 that most CLI tests train, as YAML text."""
    return TINY_MODEL


@pytest.fixture(scope="session")
def wandb_reader():
    """trackers' own reader of wandb's offline run file (its tests' conftest), loaded by path: wandb 0.31 has none."""
    import importlib.util

    path = Path(__file__).parents[1] / "packages" / "trackers" / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("trackers_test_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.read_wandb_run


def _offline_wandb_env(home: Path) -> dict[str, str]:
    """The environment of an lm-train subprocess that writes wandb offline, every wandb folder under `home`."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(home),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_SILENT": "true",
    }


@pytest.fixture(scope="session")
def offline_wandb_env():
    """The function home -> the environment of an lm-train subprocess that writes wandb offline under home."""
    return _offline_wandb_env


@dataclass
class TinyProject:
    """A working directory with a small jsonl corpus, a trained tokenizer and a config that uses them."""

    root: Path
    config: Path

    def write_config(self, name: str, text: str) -> Path:
        path = self.root / name
        path.write_text(text, encoding="utf-8")
        return path


@pytest.fixture(scope="session")
def tiny_project(tmp_path_factory) -> TinyProject:
    """Documents are real Python sources from the standard library (so the loss can fall), as jsonl."""
    from shard_cache import train_tokenizer

    root = tmp_path_factory.mktemp("project")
    data = root / "data"
    data.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in (stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))
    texts = [p.read_text(encoding="utf-8") for p in sources if p.stat().st_size > 200][:40]
    for shard in range(2):
        with open(data / f"train_{shard}.jsonl", "w", encoding="utf-8") as f:
            for text in texts[shard::2]:
                f.write(json.dumps({"text": text}) + "\n")
    with open(data / "valid.jsonl", "w", encoding="utf-8") as f:
        for text in texts[:6]:
            f.write(json.dumps({"text": text[::-1]}) + "\n")
    train_tokenizer(texts, 384, save_path=root / "tokenizer.json")
    config = root / "tiny.yaml"
    config.write_text(
        f"""\
data:
  train_urls: ["data/train_{{0..1}}.jsonl"]
  validation_urls: ["data/valid.jsonl"]
  tokenizer: tokenizer.json
  cache_dir: cache
  chunk_size: 8
  shuffle: 64
{TINY_MODEL}trainer:
  seed: 1
  num_train_steps: 12
  train_batch_size: 8
  steps_per_eval: 6
  max_eval_batches: 2
  log_every: 2
  checkpointer:
    save_interval: 1h
    keep:
      - every: 2
optimizer:
  learning_rate: 3.0e-3
  warmup: 2
""",
        encoding="utf-8",
    )
    return TinyProject(root, config)


# -- a small disk ------------------------------------------------------------------------------------------


@dataclass
class SmallDisk:
    """A tmpfs mounted by the test: a disk that fills up at a size the test chooses."""

    path: Path

    def resize(self, size: str) -> None:
        """Grow (or shrink) the disk in place; what is on it stays."""
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True, capture_output=True)

    def used_files(self) -> list[str]:
        """Every file on the disk, relative to it, sorted."""
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path):
    """The function size -> a fresh tmpfs of that size (e.g. "3m"), unmounted after the test; the test is skipped
    where mounting is impossible (it needs root on a machine that allows mounts)."""
    mounted: list[Path] = []

    def mount(size: str) -> SmallDisk:
        point = tmp_path / f"disk-{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(
                f"cannot mount a small tmpfs here ({done.stderr.decode().strip() or done.returncode}): no full disk"
            )
        mounted.append(point)
        return SmallDisk(point)

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


# -- multi-process launcher ---------------------------------------------------------------------------------
# Appended block (scaling/multi-process tests). N Python processes on localhost that join one jax.distributed
# run (gloo CPU collectives) through lm_train's LM_TRAIN_* variables; each one's exit code, output and result
# file are collected; one failure or a hang fails the test with every process's output, and kills the rest.

MP_RESULT_ENV = "MP_RESULT_FILE"
"""Env var naming the JSON file where a launched process may write its result (read back as `.result`)."""


@dataclass
class ProcessResult:
    """What one launched process left behind."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    result: object = None
    """The JSON that the process wrote to $MP_RESULT_FILE, or None."""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def free_port() -> int:
    """A TCP port that was free a moment ago (for the jax.distributed coordinator)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(process: subprocess.Popen) -> None:
    """Kill a launched process and whatever it started (it leads its own session)."""
    import contextlib
    import signal

    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def launch_processes(
    args: list[str] | object,
    num_processes: int,
    *,
    cwd: Path | object,
    log_dir: Path,
    devices_per_process: int = 4,
    env: dict[str, str] | object | None = None,
    timeout: float = 300,
    grace: float = 3.0,
    kill_when: object = None,
) -> list[ProcessResult]:
    """Start `args` (a list, or a function rank -> list) `num_processes` times as one jax.distributed run.

    Process i gets LM_TRAIN_COORDINATOR_ADDRESS / LM_TRAIN_NUM_PROCESSES / LM_TRAIN_PROCESS_ID (read by
    lm_train.run.distributed.initialize_distributed), XLA_FLAGS forcing `devices_per_process` CPU devices, and
    $MP_RESULT_FILE; `cwd` and `env` may be functions of the rank too. Returns every process's result when all
    exit 0; otherwise, or after `timeout` seconds, kills the rest and fails the test with the exit code and
    output of every process. `kill_when`, a function of no argument, is polled while they run: once it returns
    true every process is SIGKILLed at once and their results are returned (exit code -9), as a preemption.
    """
    import time

    log_dir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    processes: list[subprocess.Popen] = []
    files = []
    try:
        for rank in range(num_processes):
            argv = args(rank) if callable(args) else list(args)
            process_env = dict(os.environ)
            process_env.update(
                XLA_FLAGS=xla_flags(devices_per_process),
                JAX_PLATFORMS="cpu",
                LM_TRAIN_COORDINATOR_ADDRESS=address,
                LM_TRAIN_NUM_PROCESSES=str(num_processes),
                LM_TRAIN_PROCESS_ID=str(rank),
                **{MP_RESULT_ENV: str(log_dir / f"result-{rank}.json")},
            )
            process_env.update((env(rank) if callable(env) else env) or {})
            out = open(log_dir / f"stdout-{rank}.txt", "w+", encoding="utf-8")  # noqa: SIM115
            err = open(log_dir / f"stderr-{rank}.txt", "w+", encoding="utf-8")  # noqa: SIM115
            files.append((out, err))
            processes.append(
                subprocess.Popen(
                    argv,
                    cwd=cwd(rank) if callable(cwd) else cwd,
                    env=process_env,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        problem = None
        while True:
            codes = [p.poll() for p in processes]
            if all(c == 0 for c in codes):
                break
            if kill_when is not None and all(c is None for c in codes) and kill_when():
                for p in processes:  # all at once, as a lost slice: nobody gets to save or say goodbye
                    os.killpg(p.pid, signal.SIGKILL)
                break
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Let the others notice and report (or finish) for a moment, then stop them.
                stop_at = time.monotonic() + grace
                while time.monotonic() < stop_at and any(p.poll() is None for p in processes):
                    time.sleep(0.1)
                problem = f"process {failed[0]} exited with code {codes[failed[0]]}"
                break
            if time.monotonic() > deadline:
                hung = [i for i, c in enumerate(codes) if c is None]
                problem = f"timeout after {timeout:.0f} s: process(es) {hung} still running (hang?)"
                break
            time.sleep(0.1)
    finally:
        for p in processes:
            _kill_group(p)
    results = []
    for rank, (p, (out, err)) in enumerate(zip(processes, files, strict=True)):
        out.seek(0)
        err.seek(0)
        result_file = log_dir / f"result-{rank}.json"
        result = json.loads(result_file.read_text(encoding="utf-8")) if result_file.exists() else None
        results.append(ProcessResult(rank, p.returncode, out.read(), err.read(), result))
        out.close()
        err.close()
    if problem is not None:
        report = [f"multi-process run failed: {problem}; command {args if not callable(args) else args(0)}"]
        for r in results:
            report.append(f"----- process {r.rank}: exit code {r.returncode} -----")
            report.append("stdout:\n" + _tail(r.stdout, 2000))
            report.append("stderr:\n" + _tail(r.stderr))
        pytest.fail("\n".join(report), pytrace=False)
    return results


@pytest.fixture(scope="session")
def launch():
    """The function `launch_processes(args, n, cwd=..., log_dir=..., ...)`: N processes in one jax.distributed run."""
    return launch_processes


# -- a SLURM cluster ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """slurmctld and four slurmd "nodes" on localhost (slurm_cluster.py). Without SLURM's binaries or root it skips
    here and fails in CI (CI=true), whose .ci/run installs them."""
    from slurm_cluster import INSTALL, missing_binaries, start_cluster

    missing = missing_binaries()
    reason = (
        f"SLURM is not installed here (missing: {', '.join(missing)}); install it with `{INSTALL}`, as root"
        if missing
        else ("the SLURM daemons of the test cluster must run as root" if os.geteuid() != 0 else "")
    )
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}: CI must run the SLURM tests.", pytrace=False)
        pytest.skip(reason)
    started = time.perf_counter()
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    print(f"\nslurm_cluster: {len(cluster.nodes)} nodes up in {time.perf_counter() - started:.2f} s")
    saved = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env())  # the launcher's sbatch, squeue and scontrol find this cluster
    try:
        yield cluster
    finally:
        cluster.stop()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


# -- SFT project --------------------------------------------------------------------------------------------
# An HF tokenizer directory with a chat template, synthetic conversations, and a tiny Llama exported in Hugging
# Face format (the base that SFT and LoRA runs tune).

# ChatML without generation tags (what most tokenizer_config.json files carry): assistant spans are then found
# by rendering incrementally.
CHATML = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message['role'] == 'system' %}{% continue %}{% endif %}
    {%- if message['role'] not in ['user', 'assistant', 'system'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# The same with {% generation %} tags: transformers needs them to return its assistant mask (the reference).
CHATML_TAGGED = CHATML.replace(
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n",
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n",
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    "add",
    "the",
    "two",
    "numbers",
    "then",
    "sort",
    "a",
    "list",
    "of",
    "words",
    "by",
    "length",
    "and",
    "print",
    "each",
    "one",
    "twice",
    "please",
]
LLAMA = {
    "type": "llama",
    "seq_len": 64,
    "hidden_dim": 256,
    "intermediate_dim": 512,
    "num_heads": 4,
    "num_kv_heads": 2,
    "num_layers": 4,
    "gradient_checkpointing": False,
}


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversations(count: int, seed: int) -> list[list[dict]]:
    """Synthetic chats: an optional system prompt, 1-3 rounds; the assistant reverses the user's words (a rule a
    model can learn), and now and then the conversation ends on a user turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": _words(rng, 2, 6)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            ask = _words(rng, 1, 5)
            messages.append({"role": "user", "content": ask})
            messages.append({"role": "assistant", "content": " ".join(reversed(ask.split()))})
        if rng.random() < 0.1:
            messages.append({"role": "user", "content": _words(rng, 1, 4)})
        out.append(messages)
    return out


@dataclass
class SftProject:
    """A small SFT project: tokenizer directory with a chat template, conversations, base model, configs."""

    root: Path
    tokenizer: Path
    base_model: Path
    train: list[list[dict]]
    config: Path
    lora_config: Path
    tagged_template: str = CHATML_TAGGED


def _tokenizer_dir(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(7)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([_words(rng, 5, 30) for _ in range(300)], trainer)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": CHATML,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return directory


def _export_base_model(tokenizer: Path, out: Path) -> None:
    """A freshly initialised tiny Llama in Hugging Face format (the base model of the LoRA runs)."""
    import jax
    from tokenizers import Tokenizer

    import hf_bridge
    import named_tensors as nt
    from lm_models import LmConfig

    config = LmConfig.get_choice_class("llama")(**{k: v for k, v in LLAMA.items() if k != "type"})
    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    model = config.build(nt.Axis("vocab", vocab), key=jax.random.key(3))
    hf_bridge.save_pretrained(model, config, out, tokenizer=str(tokenizer / "tokenizer.json"))


def _model_yaml() -> str:
    return "model:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in LLAMA.items())


def make_sft_project(root: Path, count: int = 320) -> SftProject:
    """Write the tokenizer, the conversations (train and validation jsonl), the base model and two configs."""
    tokenizer = _tokenizer_dir(root / "tokenizer")
    chats = conversations(count, seed=5)
    train, validation = chats[: count - 32], chats[count - 32 :]
    data = root / "data"
    data.mkdir()
    for name, part in (("train_0", train[0::2]), ("train_1", train[1::2]), ("valid", validation)):
        lines = [json.dumps({"messages": c}) + "\n" for c in part]
        if name == "train_1":  # a bad record on line 4: a message without content (skipped and counted)
            lines.insert(3, json.dumps({"messages": [{"role": "user"}]}) + "\n")
        (data / f"{name}.jsonl").write_text("".join(lines), encoding="utf-8")
    _export_base_model(tokenizer, root / "base")
    common = f"""\
data:
  train_urls: ["data/train_{{0..1}}.jsonl"]
  validation_urls: ["data/valid.jsonl"]
  tokenizer: tokenizer
  cache_dir: cache
  chunk_size: 64
  format: chat
  pack: true
  on_bad_input: skip
  shuffle: 32
{_model_yaml()}initialize_from_hf: base
trainer:
  seed: 2
  num_train_steps: 8
  train_batch_size: 8
  steps_per_eval: 8
  max_eval_batches: 1
  log_every: 2
  checkpointer:
    save_interval: 1h
    keep:
      - every: 2
optimizer:
  learning_rate: 1.0e-2
  warmup: 1
"""
    config = root / "sft.yaml"
    config.write_text(common, encoding="utf-8")
    lora = root / "lora.yaml"
    lora.write_text(common + "lora:\n  r: 8\n  alpha: 16\n  target_modules: [q_proj, v_proj]\n", encoding="utf-8")
    return SftProject(root, tokenizer, root / "base", train, config, lora)


@pytest.fixture(scope="session")
def sft_project(tmp_path_factory) -> SftProject:
    """The SFT project (written once per session)."""
    return make_sft_project(tmp_path_factory.mktemp("sft"))
