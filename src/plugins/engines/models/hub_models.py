"""Models by name on the Hugging Face Hub: ``hf:<org>/<repo>[@<revision>][:<quant>]`` or
``hf:<org>/<repo>[@<revision>]/<path/in/repo.gguf>``.

huggingface_hub fetches, resumes and caches (in ``HF_HUB_CACHE``, by default ``$HF_HOME/hub``); this module names
the files. A GGUF is picked as llama-server's ``-hf <repo>[:<quant>]`` picks it (llama.cpp's
``common/download.cpp``): among the model GGUFs in path order (not ``mmproj``, ``imatrix``... files), the first whose
path holds the tag followed by ``.`` or ``-``, case-insensitive; with no tag, Q4_K_M, then Q8_0, then the first model
GGUF. A split GGUF (``-00001-of-0000N.gguf``) comes with all its parts, and the first part is the one to load. A repo
named without a tag or file that holds safetensors is a model directory instead (the torch, vLLM and SGLang
engines): its config, tokenizer and safetensors files.

The cache is asked first, with no request to the hub, so a cached model starts offline; ``headrace pull`` asks the
hub first, so it also fetches a newer revision. With ``HF_HUB_OFFLINE=1`` a model missing from the cache is a
:class:`ModelNotFound` naming ``headrace pull``.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from headrace.plugins.engines.models.paths import ModelNotFound

log = logging.getLogger(__name__)

PREFIX = "hf:"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama-server's picks when a repo is named without a tag
# GGUFs that ride along with a model and are never the model itself (llama.cpp's gguf_filename_is_model).
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
# What a safetensors model directory needs: config, tokenizer, chat template, weights; not the .bin, .pt, ONNX
# or GGUF copies many repos also carry.
DIRECTORY_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_REF = re.compile(r"hf:(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w.-]+))?"
                  r"(?::(?P<quant>[\w.-]+)|/(?P<file>[^:@]+\.gguf))?")
GRAMMAR = "hf:<org>/<repo>[@<revision>][:<quant>] or hf:<org>/<repo>[@<revision>]/<file>.gguf"


@dataclass(frozen=True)
class HubModel:
    ref: str  # as configured
    repo: str
    revision: str  # a branch, tag or commit; "main" unless pinned
    quant: str | None = None
    file: str | None = None

    @property
    def pinned(self) -> bool:
        """Pinned to a commit: what is cached can never be stale."""
        return re.fullmatch(r"[0-9a-f]{40}", self.revision) is not None


@dataclass(frozen=True)
class Pick:
    files: tuple[str, ...]  # what to fetch
    load: str  # the file to load (a GGUF, a split's first part), or "" for the directory itself
    others: tuple[str, ...] = ()  # other GGUFs the tag matched: the path order decided between them

    def describe(self) -> str:
        also = f"; also tagged so: {', '.join(self.others)}" if self.others else ""
        return f"{self.load or 'the model directory'}{also}"


def is_hub_ref(ref: str | None) -> bool:
    return bool(ref) and ref.startswith(PREFIX)


def parse(ref: str, key: str = "model") -> HubModel:
    match = _REF.fullmatch(ref)
    if match is None:
        raise ValueError(f"{key}: {ref!r} is not a Hugging Face model name; write {GRAMMAR}")
    return HubModel(ref, match["repo"], match["revision"] or "main", match["quant"], match["file"])


def pick(model: HubModel, files: Iterable[str]) -> Pick:
    """The files ``model`` names among a repo's ``files``, chosen the same way whether they are listed by the hub
    or by the cache, so a model resolves to the same file online and offline."""
    files = sorted(files)
    if model.file is not None:
        if model.file not in files:
            raise ModelNotFound(f"{model.ref}: no file {model.file} in {model.repo}{_available(files)}")
        return _with_parts(model.file, files, model)
    if model.quant is None and any(f.endswith(".safetensors") for f in files):
        weights = [f for f in files if any(fnmatch(f, p) for p in DIRECTORY_FILES)]
        return Pick(tuple(weights), "")
    models = [f for f in files if _is_model_gguf(f)]
    for tag in [model.quant] if model.quant else DEFAULT_QUANTS:
        tagged = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        matching = [f for f in models if tagged.search(f)]
        if matching:
            chosen = _with_parts(matching[0], files, model)
            # Say which, when the name alone did not decide.
            return Pick(chosen.files, chosen.load, tuple(f for f in matching if f != chosen.load))
    if model.quant is None and models:
        return _with_parts(models[0], files, model)
    wanted = f"no GGUF tagged {model.quant}" if model.quant else "no safetensors and no GGUF"
    raise ModelNotFound(f"{model.ref}: {wanted} in {model.repo}{_available(files)}")


def _is_model_gguf(path: str) -> bool:
    name = PurePosixPath(path).name
    split = _SPLIT.search(name)
    first = split is None or int(split[1]) == 1  # a split is named by its first part
    return name.endswith(".gguf") and first and not any(word in name for word in NOT_MODELS)


def _with_parts(path: str, files: list[str], model: HubModel) -> Pick:
    split = _SPLIT.search(path)
    if split is None:
        return Pick((path,), path)
    parts = [f"{path[:split.start()]}-{i:05d}-of-{split[2]}.gguf" for i in range(1, int(split[2]) + 1)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise ModelNotFound(f"{model.ref}: the split GGUF {parts[0]} lacks its parts {', '.join(missing)}")
    return Pick(tuple(parts), parts[0])


def _available(files: list[str]) -> str:
    ggufs = [f for f in files if f.endswith(".gguf")]
    return f" (its GGUF files: {', '.join(ggufs)})" if ggufs else " (it holds no GGUF)"


# ----- resolving: the cache first, then the hub ------------------------------------------------


def resolve(ref: str, key: str = "model") -> Path:
    """The local path of ``ref``: from the cache when it is there (no request to the hub), else fetched."""
    model = parse(ref, key)
    cached = cached_path(model)
    if cached is not None:
        return cached
    if _hub().constants.is_offline_mode():
        raise ModelNotFound(_offline_message(model, key))
    return fetch(model, key)


def pull(ref: str, key: str = "model") -> Path:
    """``headrace pull``: the hub first, so a newer revision of a branch is fetched too; offline, the cache."""
    model = parse(ref, key)
    if _hub().constants.is_offline_mode() or model.pinned:
        return resolve(ref, key)
    return fetch(model, key)


def cached_path(model: HubModel) -> Path | None:
    """``model`` from the cache, complete, or None; never a request to the hub."""
    hub = _hub()
    files = _cached_listing(model)
    if files is None:
        return None
    try:
        chosen = pick(model, files)
        folder = Path(hub.snapshot_download(model.repo, revision=model.revision, local_files_only=True,
                                            allow_patterns=[glob.escape(f) for f in chosen.files]))
    except (ModelNotFound, hub.errors.LocalEntryNotFoundError):
        return None
    if not all((folder / f).exists() for f in chosen.files):  # an earlier fetch was cut short
        return None
    log.debug("%s: %s, from the cache", model.ref, chosen.describe())
    return folder / chosen.load


def _cached_listing(model: HubModel) -> list[str] | None:
    """The repo's files at the revision, as the cache knows them: the listing ``snapshot_download`` kept; else
    (files fetched one by one, by another tool) the files in the cached snapshot, as llama.cpp lists them offline."""
    hub = _hub()
    try:
        return [f.path for f in hub.get_cached_repo_tree(model.repo, revision=model.revision)]
    except hub.errors.CachedRepoTreeNotFoundError:
        pass
    try:
        folder = Path(hub.snapshot_download(model.repo, revision=model.revision, local_files_only=True))
    except hub.errors.LocalEntryNotFoundError:
        return None
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]


def fetch(model: HubModel, key: str = "model") -> Path:
    """Ask the hub for the repo's files, pick, and fetch what the cache lacks (a progress bar on stderr)."""
    hub = _hub()
    endpoint = hub.constants.ENDPOINT
    try:
        files = hub.HfApi().list_repo_files(model.repo, revision=model.revision)
        chosen = pick(model, files)
        print(f"headrace: fetching {model.ref} ({chosen.describe()}) from {endpoint} into "
              f"{hub.constants.HF_HUB_CACHE}", file=sys.stderr, flush=True)
        folder = Path(hub.snapshot_download(model.repo, revision=model.revision,
                                            allow_patterns=[glob.escape(f) for f in chosen.files]))
    except ModelNotFound as exc:
        raise ModelNotFound(f"{key}: {exc}") from None
    except hub.errors.RevisionNotFoundError:
        raise ModelNotFound(f"{key}: {model.ref}: {model.repo} has no revision {model.revision!r} on "
                            f"{endpoint}") from None
    except hub.errors.RepositoryNotFoundError:
        raise ModelNotFound(f"{key}: {model.ref}: no model repository {model.repo} on {endpoint} (a private or "
                            "gated one needs a token: HF_TOKEN or `hf auth login`)") from None
    except Exception as exc:  # the hub unreachable or failing, the disk full: say which, and how to try again
        raise ModelNotFound(f"{key}: {model.ref} could not be fetched from {endpoint} ({type(exc).__name__}: "
                            f"{exc}); try again with `headrace pull {model.ref}`") from exc
    return folder / chosen.load


def _offline_message(model: HubModel, key: str) -> str:
    cache = _hub().constants.HF_HUB_CACHE
    return (f"{key}: {model.ref} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 forbids fetching "
            f"it: run `headrace pull {model.ref}` where HF_HUB_OFFLINE is unset (the same HF_HOME), then start again")


def _hub() -> Any:
    import huggingface_hub
    import huggingface_hub.constants  # noqa: F401 (submodules: attributes only once imported)
    import huggingface_hub.errors  # noqa: F401

    return huggingface_hub


# ----- the CLI's part: fetch before the engines load --------------------------------------------


def config_models(config: Any) -> list[tuple[str, str]]:
    """``(key, model)`` for each engine of ``config`` that names an ``hf:`` model."""
    return [(f"engines.{e.name}.model", e.model) for e in config.engines if is_hub_ref(e.model)]


def fetch_config_models(config: Any) -> None:
    """Fetch the ``hf:`` models of ``config`` that the cache lacks, once, before any engine is built (an engine
    resolves its model again, from the cache). huggingface_hub is imported only for a config that has one."""
    for key, ref in config_models(config):
        resolve(ref, key)


def offline_by_default() -> None:
    """``HF_HUB_OFFLINE=1`` unless the user set it: once the ``hf:`` models are here, the engines (transformers)
    never reach for a hub. huggingface_hub reads the variable when it is imported, which fetching may have done."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = os.environ["HF_HUB_OFFLINE"].upper() in constants.ENV_VARS_TRUE_VALUES
