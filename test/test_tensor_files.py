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
