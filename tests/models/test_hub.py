"""blink.models.hub: model ids resolved offline from a cache laid out the way huggingface_hub lays it out."""
import pytest

from blink.models.hub import hub_cache, resolve_model


def cached(root, model_id, files=("config.json",), revision="main", commit="0123abcd"):
    repo = root / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(commit)
    for name in files:
        (snapshot / name).write_text("{}")
    return snapshot


def test_an_id_in_the_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = cached(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == snapshot
    assert resolve_model(str(snapshot)) == snapshot                 # a directory is itself


def test_the_cache_follows_hf_home_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub_cache() == tmp_path / "hub"
    snapshot = cached(tmp_path / "hub", "org/model")
    assert resolve_model("org/model") == snapshot


def test_an_unknown_id_says_ids_come_from_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="resolves model ids from the local cache only.*huggingface-cli "
                                                "download org/absent"):
        resolve_model("org/absent")


def test_the_engine_serves_a_model_by_its_cached_id(tmp_path, monkeypatch):
    """The default model's files, laid out as a cache entry, load and serve through EngineConfig(model=ID)."""
    from blink import Engine, EngineConfig, SamplingParams, SchedulerConfig
    from blink.models import default_model_path

    source = default_model_path()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = cached(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct", files=())
    for f in source.iterdir():
        (snapshot / f.name).symlink_to(f)
    config = EngineConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct", device="cpu", n_slots=2, sim_threads=2,
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=40),
                          cpu_kv_cache_gib=0.05)
    with Engine(config) as engine:
        out = engine.generate("Hello", SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) == 3


def test_a_revision_and_another_cache_pick_that_snapshot(tmp_path, monkeypatch):
    """``resolve_model(id, revision, cache)``: vLLM's --revision and --download-dir. A branch or tag is read from
    refs/, a commit is a snapshot's own name; the cache named is searched instead of $HF_HUB_CACHE's."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    main = cached(tmp_path, "org/model")
    tagged = tmp_path / "models--org--model" / "snapshots" / "4567cdef"
    tagged.mkdir()
    (tmp_path / "models--org--model" / "refs" / "v1").write_text("4567cdef")
    assert resolve_model("org/model", cache=tmp_path) == main
    assert resolve_model("org/model", "v1", tmp_path) == resolve_model("org/model", "4567cdef", tmp_path) == tagged
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        resolve_model("org/model", "v2", tmp_path)
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        resolve_model("org/model")


def test_no_name_is_the_embedded_default_model():
    from blink.models import default_model_path

    assert resolve_model(None) == default_model_path()
