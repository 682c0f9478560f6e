"""The generic weight readers every family goes through: sharded safetensors (a missing shard is
named), PyTorch files without pickled code, NeMo tars, and name schemas that refuse strangers."""
import io
import json
import pickle
import tarfile

import pytest
import torch
from safetensors.torch import save_file

from photon_core.weights.tensor_files import (default_dtype, parse_dtype, read_folder, read_nemo, read_safetensors,
                                              read_torch, rename)


def test_sharded_safetensors_read_whole_and_a_missing_shard_is_named(tmp_path):
    a, b = {"x.weight": torch.randn(3, 4)}, {"y.bias": torch.randn(5)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"x.weight": "model-00001-of-00002.safetensors",
                            "y.bias": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = read_folder(tmp_path)
    assert set(got) == {"x.weight", "y.bias"} and torch.equal(got["y.bias"], b["y.bias"])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        read_safetensors(tmp_path)


@pytest.mark.parametrize("text", ['{"weight_map": ', '{"metadata": {}}', '[1]', '{"weight_map": {"x": ["a"]}}'],
                         ids=["truncated", "no-map", "list", "shard-not-a-name"])
def test_a_malformed_shard_index_is_a_value_error_naming_it(tmp_path, text):
    save_file({"x": torch.zeros(2)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match="model.safetensors.index.json: .*shard index"):
        read_folder(tmp_path)


def test_torch_files_load_without_running_pickled_code(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    assert torch.equal(read_torch(tmp_path / "ok.pt")["w"], torch.ones(2))

    class Evil:
        def __reduce__(self):
            return (exec, ("raise SystemExit('code ran')",))
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(Exception) as err:
        read_torch(tmp_path / "evil.pt")
    assert not isinstance(err.value, SystemExit)


def test_nemo_tar_gives_config_and_state(tmp_path):
    state = {"encoder.w": torch.randn(2, 3)}
    buf = io.BytesIO()
    torch.save(state, buf)
    path = tmp_path / "model.nemo"
    with tarfile.open(path, "w") as tar:
        for name, data in (("./model_config.yaml", b"sample_rate: 16000\nencoder: {d_model: 8}\n"),
                           ("./model_weights.ckpt", buf.getvalue())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    config, got = read_nemo(path)
    assert config["encoder"]["d_model"] == 8 and torch.equal(got["encoder.w"], state["encoder.w"])


def test_rename_follows_the_schema_and_refuses_strangers():
    t = torch.zeros(1)
    rules = [(r"model\.layers\.(\d+)\.q_proj\.(weight|bias)", r"blocks.\1.query.\2")]
    got = rename({"model.layers.3.q_proj.weight": t, "lm_head.weight": t, "blocks.0.x": t}, rules,
                 keep=(r"blocks\..*",), drop=(r"lm_head\.weight",))
    assert set(got) == {"blocks.3.query.weight", "blocks.0.x"}
    with pytest.raises(ValueError, match="unexpected tensor 'other'"):
        rename({"other": t}, rules)


def test_dtype_names():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError):
        parse_dtype("int8")
    # Named none: bfloat16 on a GPU (the vision node's `dtype: auto`), float32 on the CPU.
    assert default_dtype("cuda:1") == "bfloat16" and default_dtype(torch.device("cpu")) == "float32"


def test_a_shard_index_naming_files_outside_the_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    save_file({"secret": torch.arange(3.0)}, str(tmp_path / "elsewhere" / "x.safetensors"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"secret": "../elsewhere/x.safetensors"}}))
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        read_safetensors(ckpt)


def test_a_legacy_torch_file_is_recognised_as_the_loader_reads_it(tmp_path):
    """A .pt saved in torch's legacy (non-zip) format is read by the loaders but was not by the
    registry's probe (mmap), which refused the model saying it could not be read weights-only."""
    import shutil

    import moondream_fixtures as mdfx
    from safetensors.torch import load_file

    import photon_core
    src = mdfx.checkpoint()
    shutil.copy(src / "config.json", tmp_path)
    shutil.copy(src / "tokenizer.json", tmp_path)
    torch.save(load_file(str(src / "model.safetensors")), tmp_path / "model.pt", _use_new_zipfile_serialization=False)
    assert type(photon_core.load(tmp_path)).__name__ == "MoondreamModel"


def _hf_cache_snapshot(tmp_path, files):
    """A folder laid out as `hf download` leaves it: the content in
    models--org--name/blobs/<sha>, and snapshots/<rev>/<name> a relative symlink into ../../blobs.
    `files` maps each snapshot name to a function writing the blob at the path it is given."""
    import os
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, (name, write) in enumerate(files.items()):
        blob = blobs / f"{i:040x}"
        write(blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    return snap


def test_a_sharded_checkpoint_in_a_hugging_face_cache_snapshot_loads(tmp_path):
    """Every file of a hub cache snapshot is a symlink into ../../blobs/; the shard index check
    once resolved those links and refused every sharded model loaded from the cache as naming
    files outside the checkpoint folder."""
    a, b = {"x.weight": torch.randn(3, 4)}, {"y.bias": torch.randn(5)}
    index = {"weight_map": {"x.weight": "model-00001-of-00002.safetensors",
                            "y.bias": "model-00002-of-00002.safetensors"}}
    snap = _hf_cache_snapshot(tmp_path, {
        "model-00001-of-00002.safetensors": lambda p: save_file(a, str(p)),
        "model-00002-of-00002.safetensors": lambda p: save_file(b, str(p)),
        "model.safetensors.index.json": lambda p: p.write_text(json.dumps(index))})
    assert (snap / "model-00001-of-00002.safetensors").is_symlink()
    got = read_folder(snap)   # what the family loaders call on a folder
    assert torch.equal(got["x.weight"], a["x.weight"]) and torch.equal(got["y.bias"], b["y.bias"])


def test_a_tiny_model_loads_end_to_end_from_a_hugging_face_cache_snapshot(tmp_path):
    """The same through photon_core.load: a tiny Qwen3-ASR checkpoint saved in two shards, every
    file of it a symlink into the cache's blobs, as a user gets it from `hf download`."""
    import shutil

    from safetensors.torch import load_file
    from test_qwen3_asr_reference import tiny_checkpoint

    import photon_core
    src = tiny_checkpoint(False)
    state = load_file(str(src / "model.safetensors"))
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    files = {name: (lambda p, ks=ks: save_file({k: state[k] for k in ks}, str(p))) for name, ks in shards.items()}
    files["model.safetensors.index.json"] = lambda p: p.write_text(
        json.dumps({"weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    for f in src.iterdir():
        if f.name != "model.safetensors":
            files[f.name] = lambda p, f=f: shutil.copy(f, p)
    assert type(photon_core.load(_hf_cache_snapshot(tmp_path, files))).__name__ == "Qwen3ASRSpeech"


def test_shard_names_are_judged_lexically(tmp_path):
    """Names that climb out of the folder or name a root or drive are refused whatever the file
    system holds (a Windows drive or UNC name counts as absolute on every platform, so an index is
    judged alike everywhere); a name that only wanders inside the folder is read."""
    save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    for bad in ("/etc/x.safetensors", "a/../../x.safetensors", "..", ".", "C:/x.safetensors",
                "C:x.safetensors", "\\\\server\\share\\x.safetensors", "..\\x.safetensors"):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": bad}}))
        with pytest.raises(ValueError, match="outside the checkpoint folder"):
            read_safetensors(tmp_path)
    (tmp_path / "sub").mkdir()
    index = {"weight_map": {"w": "sub/../model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(read_safetensors(tmp_path)["w"], torch.ones(2))
