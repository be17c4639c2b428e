"""``hf:`` models (``hub_models``): named, picked, fetched once through huggingface_hub from a stand-in hub, then
served from its cache, offline too; a model missing offline is an error naming ``headrace pull``."""

from __future__ import annotations

import filecmp

import pytest
from hub_standin import COMMIT, SMOLLM2, StandInHub, smollm2_repo

from headrace.plugins.engines.models import hub_models
from headrace.plugins.engines.models.hub_models import HubModel, parse, pick
from headrace.plugins.engines.models.paths import ModelNotFound, resolve_model

REPO = "test-org/smollm2-gguf"
Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in hub, and huggingface_hub in this process pointed at it, with an empty cache, online.

    huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, when imported: here its constants are set
    instead (tests/daemon/test_pull.py sets the variables, for a process of its own)."""
    import huggingface_hub.constants as constants

    hub = StandInHub({REPO: smollm2_repo(), "test-org/tiny-safetensors": {
        "config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}", "model.safetensors": b"\0" * 64,
        "pytorch_model.bin": b"\0" * 64, "README.md": b"# tiny\n", "1_Pooling/config.json": b"{}",
        "model.Q4_K_M.gguf": b"GGUF"}, "test-org/split-gguf": {
        f"big-Q4_K_M-0000{i}-of-00003.gguf": b"GGUF%d" % i for i in (1, 2, 3)}})
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield hub
    hub.close()


def offline(monkeypatch, value: bool = True) -> None:
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", value)


# ----- names ------------------------------------------------------------------------------------------


def test_names_parse_as_llama_server_takes_them():
    assert parse("hf:org/repo") == HubModel("hf:org/repo", "org/repo", "main")
    assert parse("hf:org/Repo-GGUF:Q4_K_M") == HubModel("hf:org/Repo-GGUF:Q4_K_M", "org/Repo-GGUF", "main", "Q4_K_M")
    assert parse("hf:org/repo@v1.2:q8_0").revision == "v1.2"
    assert parse("hf:org/repo/sub/dir/model-Q4_0.gguf").file == "sub/dir/model-Q4_0.gguf"
    assert parse(f"hf:org/repo@{COMMIT}/m.gguf").pinned
    for bad in ("hf:repo", "hf:org/repo:", "hf:org/repo/model.bin", "hf:org/repo:Q4:Q8", "hf:/repo"):
        with pytest.raises(ValueError, match="is not a Hugging Face model name; write hf:<org>/<repo>"):
            parse(bad, key="engines.llm.model")


FILES = ["README.md", "model-Q4_K_M.gguf", "model-Q4_K.gguf", "model-Q8_0.gguf", "mmproj-model-Q4_K_M.gguf",
         "model.imatrix.Q4_K_M.gguf", "sub/model-Q4_K_M.gguf", "split/model-Q6_K-00002-of-00002.gguf",
         "split/model-Q6_K-00001-of-00002.gguf"]


def test_a_tag_picks_the_first_model_gguf_that_holds_it_case_insensitively():
    assert pick(parse("hf:o/r:q4_k_m"), FILES).load == "model-Q4_K_M.gguf"
    # the tag ends at "." or "-": Q4_K is not Q4_K_M
    assert pick(parse("hf:o/r:Q4_K"), FILES).load == "model-Q4_K.gguf"
    # several files hold the tag: the first in path order, and the others are said
    chosen = pick(parse("hf:o/r:Q4_K_M"), FILES)
    assert chosen.others == ("sub/model-Q4_K_M.gguf",)
    assert "also tagged so: sub/model-Q4_K_M.gguf" in chosen.describe()
    with pytest.raises(ModelNotFound, match=r"no GGUF tagged Q5_K_M in o/r \(its GGUF files: mmproj-model-Q4_K_M"):
        pick(parse("hf:o/r:Q5_K_M"), FILES)


def test_with_no_tag_q4_k_m_then_q8_0_then_the_first_model_gguf():
    assert pick(parse("hf:o/r"), FILES).load == "model-Q4_K_M.gguf"
    assert pick(parse("hf:o/r"), ["b-Q8_0.gguf", "a-F16.gguf"]).load == "b-Q8_0.gguf"
    # never a projector or an importance matrix
    assert pick(parse("hf:o/r"), ["a-mmproj-F16.gguf", "imatrix.gguf", "z-F16.gguf"]).load == "z-F16.gguf"


def test_a_split_gguf_comes_with_every_part_and_loads_from_the_first():
    chosen = pick(parse("hf:o/r:Q6_K"), FILES)
    assert chosen.files == ("split/model-Q6_K-00001-of-00002.gguf", "split/model-Q6_K-00002-of-00002.gguf")
    assert chosen.load == "split/model-Q6_K-00001-of-00002.gguf"
    # named by any part, the same
    assert pick(parse("hf:o/r/split/model-Q6_K-00002-of-00002.gguf"), FILES) == chosen
    with pytest.raises(ModelNotFound, match="lacks its parts split/model-Q6_K-00002-of-00002.gguf"):
        pick(parse("hf:o/r:Q6_K"), FILES[:-2] + ["split/model-Q6_K-00001-of-00002.gguf"])


def test_a_repo_with_safetensors_is_a_model_directory():
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "model-00001-of-00002"
             ".safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "onnx/model.onnx", "README.md", "model-Q4_K_M.gguf"]
    chosen = pick(parse("hf:o/r"), files)
    assert chosen.load == ""
    assert set(chosen.files) == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                                 "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                 "model.safetensors.index.json"}
    assert pick(parse("hf:o/r:Q4_K_M"), files).load == "model-Q4_K_M.gguf"  # a tag still names the GGUF


# ----- fetching through the stand-in hub ----------------------------------------------------------------


def test_fetched_once_then_served_from_the_cache_online_and_offline(hub, monkeypatch, capfd):
    path = resolve_model(f"hf:{REPO}:Q4_1")
    assert path.name == Q4_1 and filecmp.cmp(path, SMOLLM2, shallow=False)
    assert len(hub.downloads(Q4_1)) == 1
    assert f"fetching hf:{REPO}:Q4_1 ({Q4_1})" in capfd.readouterr().err  # what comes, before its progress bar

    asked = hub.count()
    assert resolve_model(f"hf:{REPO}:q4_1") == path  # cached: not one request, though online
    assert hub.count() == asked
    offline(monkeypatch)
    assert resolve_model(f"hf:{REPO}:Q4_1", key="engines.smollm2.model") == path
    assert hub.count() == asked


def test_missing_offline_is_an_error_naming_headrace_pull(hub, monkeypatch):
    offline(monkeypatch)
    with pytest.raises(ModelNotFound) as caught:
        resolve_model(f"hf:{REPO}:Q8_0", key="engines.smollm2.model")
    message = str(caught.value)
    assert message.startswith(f"engines.smollm2.model: hf:{REPO}:Q8_0 is not in the Hugging Face cache")
    assert f"run `headrace pull hf:{REPO}:Q8_0`" in message and "HF_HUB_OFFLINE" in message
    assert hub.count() == 0
    # cached, but another quantization: missing all the same
    offline(monkeypatch, False)
    resolve_model(f"hf:{REPO}:Q8_0")
    offline(monkeypatch)
    with pytest.raises(ModelNotFound, match="headrace pull hf:test-org/smollm2-gguf:Q4_1"):
        resolve_model(f"hf:{REPO}:Q4_1")


def test_an_interrupted_download_resumes_where_it_stopped(hub):
    hub.cut.add(Q4_1)  # the first response stops halfway: a dropped connection
    path = resolve_model(f"hf:{REPO}:Q4_1")
    first, second = hub.downloads(Q4_1)
    assert "Range" not in first and "range" not in first
    start = int((second.get("Range") or second["range"]).removeprefix("bytes=").removesuffix("-"))
    assert 0 < start < SMOLLM2.stat().st_size  # not from the start: what had arrived was kept
    assert filecmp.cmp(path, SMOLLM2, shallow=False)


def test_the_default_pick_and_the_projector_left_behind(hub):
    path = resolve_model(f"hf:{REPO}")  # no Q4_K_M in the repo: Q8_0, as llama-server
    assert path.name == "SmolLM2-135M-Instruct.Q8_0.gguf"
    assert hub.downloads("mmproj-SmolLM2-Q8_0.gguf") == []


def test_a_safetensors_repo_is_fetched_as_a_directory_without_the_other_weights(hub):
    path = resolve_model("hf:test-org/tiny-safetensors")
    assert path.is_dir()
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == [
        "1_Pooling/config.json", "config.json", "model.safetensors", "tokenizer.json"]
    assert hub.downloads("pytorch_model.bin") == [] and hub.downloads("model.Q4_K_M.gguf") == []


def test_a_split_gguf_fetches_every_part(hub, monkeypatch):
    path = resolve_model("hf:test-org/split-gguf:Q4_K_M")
    assert path.name == "big-Q4_K_M-00001-of-00003.gguf"
    assert [(path.parent / f"big-Q4_K_M-0000{i}-of-00003.gguf").read_bytes() for i in (1, 2, 3)] == \
        [b"GGUF1", b"GGUF2", b"GGUF3"]
    offline(monkeypatch)  # cached whole: offline too
    assert resolve_model("hf:test-org/split-gguf/big-Q4_K_M-00003-of-00003.gguf") == path


def test_a_pinned_revision_and_a_file_by_name(hub, monkeypatch):
    path = resolve_model(f"hf:{REPO}@{COMMIT}/SmolLM2-135M-Instruct.Q8_0.gguf")
    assert path.parent.name == COMMIT
    offline(monkeypatch)
    assert resolve_model(f"hf:{REPO}@{COMMIT}:Q8_0") == path
    offline(monkeypatch, False)
    with pytest.raises(ModelNotFound, match="test-org/smollm2-gguf has no revision 'v9'"):
        resolve_model(f"hf:{REPO}@v9:Q8_0")


def test_hub_errors_say_what_is_wrong(hub):
    with pytest.raises(ModelNotFound, match="engines.x.model: hf:test-org/nope: no model repository test-org/nope"):
        resolve_model("hf:test-org/nope", key="engines.x.model")
    with pytest.raises(ModelNotFound, match=r"no file nope.gguf in test-org/smollm2-gguf \(its GGUF files"):
        resolve_model(f"hf:{REPO}/nope.gguf")


def test_pull_asks_the_hub_again_and_resolve_does_not(hub):
    path = hub_models.pull(f"hf:{REPO}:Q8_0")
    asked = hub.count()
    assert hub_models.pull(f"hf:{REPO}:Q8_0") == path
    assert hub.count() > asked  # a newer revision of main would have come
    assert len(hub.downloads("SmolLM2-135M-Instruct.Q8_0.gguf")) == 1  # but the file, unchanged, did not


def test_offline_by_default_reaches_huggingface_hub_imported_before_it(monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub_models.offline_by_default()
    assert constants.is_offline_mode()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user's word wins
    hub_models.offline_by_default()
    assert not constants.is_offline_mode()
