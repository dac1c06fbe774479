"""EAGLE-3 HF export (`nemo-tlt convert --from drafter --to eagle3-hf`): the names,
shapes and config keys of the layout vLLM / SGLang / TensorRT-LLM load, and a
bit-exact read back."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nemo_tlt.convert import main
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import read_eagle3_hf, write_eagle3_hf
from nemo_tlt.drafter.io import load_drafter, save_drafter
from tiny import tiny_config, tiny_target


def _drafter() -> Eagle3Drafter:
    cfg = tiny_config(num_layers=8, num_heads=4, num_kv_heads=2)  # H 32, head_dim 8, vocab 32
    d = Eagle3Drafter(Eagle3Config.from_target(cfg, draft_vocab_size=6, ttt_steps=2),
                      generator=torch.Generator().manual_seed(0))
    d.set_draft_vocab(torch.tensor([1, 2, 7, 8, 20, 31]))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
    return d


def test_export_layout_and_bit_exact_read_back(tmp_path):
    drafter = _drafter()
    save_drafter(drafter, tmp_path / "d")
    assert main(["--from", "drafter", "--to", "eagle3-hf", "--input", str(tmp_path / "d"),
                 "--output", str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["draft_vocab_size"], cfg["vocab_size"], cfg["hidden_size"],
            cfg["target_hidden_size"], cfg["head_dim"]) == (1, 6, 32, 32, 32, 8)
    assert drafter.capture_layers == (1, 3, 4)  # TensorRT-LLM's default for 8 layers
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: input of layer i + 1
    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    assert shapes == {
        "fc.weight": (32, 96), "midlayer.input_layernorm.weight": (32,), "midlayer.hidden_norm.weight": (32,),
        "midlayer.self_attn.q_proj.weight": (32, 64), "midlayer.self_attn.k_proj.weight": (16, 64),
        "midlayer.self_attn.v_proj.weight": (16, 64), "midlayer.self_attn.o_proj.weight": (32, 32),
        "midlayer.post_attention_layernorm.weight": (32,), "midlayer.mlp.gate_proj.weight": (64, 32),
        "midlayer.mlp.up_proj.weight": (64, 32), "midlayer.mlp.down_proj.weight": (32, 64),
        "norm.weight": (32,), "lm_head.weight": (6, 32), "d2t": (6,), "t2d": (32,)}
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert (torch.arange(6) + w["d2t"]).tolist() == [1, 2, 7, 8, 20, 31]  # target id = draft id + d2t
    back = read_eagle3_hf(tmp_path / "hf")
    assert back.config == drafter.config
    a, b = drafter.state_dict(), back.state_dict()
    assert list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert main(["--from", "eagle3-hf", "--to", "drafter", "--input", str(tmp_path / "hf"),
                 "--output", str(tmp_path / "d2")]) == 0
    again = load_drafter(tmp_path / "d2").state_dict()
    assert all(torch.equal(a[k], again[k]) for k in a)


def _exported_keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _same_drafter(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    """Identical config and state dict (names, order, dtypes, values), and identical outputs."""
    assert b.config == a.config
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    target = tiny_target(seed=2, num_layers=8, num_heads=4, num_kv_heads=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (2, 5), generator=g)
    features = torch.randn(2, 5, a.feature_width, generator=g)
    with torch.no_grad():
        outs = [d.draft_logits(target, d(target, tokens, d.fuse(features))) for d in (a.eval(), b)]
    assert torch.equal(*outs) and outs[0].shape == (2, 5, 32)


def test_full_vocab_export_has_no_maps_and_reads_back_exactly(tmp_path):
    """vLLM has no draft_id_to_target_id parameter for a full draft vocabulary and refuses a d2t."""
    cfg = tiny_config(num_layers=8, num_heads=4, num_kv_heads=2)
    drafter = Eagle3Drafter(Eagle3Config.from_target(cfg, ttt_steps=2), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
    assert drafter.full_vocab
    (tmp_path / "hf").mkdir()
    write_eagle3_hf(drafter, tmp_path / "hf")
    keys = _exported_keys(tmp_path / "hf")
    assert "d2t" not in keys and "t2d" not in keys and "lm_head.weight" in keys
    assert keys == set(drafter.state_dict()) - {"d2t", "t2d"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["draft_vocab_size"] == 32
    _same_drafter(drafter, read_eagle3_hf(tmp_path / "hf"))


def test_smaller_draft_vocab_export_writes_both_maps_and_reads_back_exactly(tmp_path):
    drafter = _drafter()
    (tmp_path / "hf").mkdir()
    write_eagle3_hf(drafter, tmp_path / "hf")
    assert _exported_keys(tmp_path / "hf") == set(drafter.state_dict()) and {"d2t", "t2d"} <= set(drafter.state_dict())
    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(w["d2t"], drafter.d2t) and torch.equal(w["t2d"], drafter.t2d)
    back = read_eagle3_hf(tmp_path / "hf")
    assert (torch.arange(6) + back.d2t).tolist() == [1, 2, 7, 8, 20, 31]
    _same_drafter(drafter, back)


def test_bf16_export_reads_back_in_bf16(tmp_path):
    drafter = _drafter()
    save_drafter(drafter, tmp_path / "d")
    assert main(["--from", "drafter", "--to", "eagle3-hf", "--input", str(tmp_path / "d"),
                 "--output", str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    back = read_eagle3_hf(tmp_path / "hf")
    assert back.fc.weight.dtype == torch.bfloat16 and back.d2t.dtype == torch.int64
    assert torch.equal(back.fc.weight, drafter.fc.weight.to(torch.bfloat16))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_third_party_folder_without_our_block_uses_the_aux_layer_ids(tmp_path):
    drafter = _drafter()
    save_drafter(drafter, tmp_path / "d")
    main(["--from", "drafter", "--to", "eagle3-hf", "--input", str(tmp_path / "d"), "--output", str(tmp_path / "hf")])
    path = tmp_path / "hf" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["nemo_tlt"]
    path.write_text(json.dumps(cfg))
    assert read_eagle3_hf(tmp_path / "hf").capture_layers == (1, 3, 4)


def test_errors(tmp_path, capsys):
    save_drafter(EagleDrafter(EagleConfig.from_target(tiny_config())), tmp_path / "e2")
    assert main(["--from", "drafter", "--to", "eagle3-hf", "--input", str(tmp_path / "e2"),
                 "--output", str(tmp_path / "out")]) == 2
    assert "only kind 'eagle3'" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["--from", "drafter", "--to", "trtllm", "--input", str(tmp_path / "e2"),
                 "--output", str(tmp_path / "out")]) == 2
    save_drafter(_drafter(), tmp_path / "d")
    main(["--from", "drafter", "--to", "eagle3-hf", "--input", str(tmp_path / "d"), "--output", str(tmp_path / "hf")])
    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    from safetensors.torch import save_file
    save_file({k: v for k, v in w.items() if k != "d2t"}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['d2t'\\]"):
        read_eagle3_hf(tmp_path / "hf")


@pytest.mark.parametrize("layers", [(4, 1, 3), (0, 0, 1)], ids=["unsorted", "repeated"])
def test_a_drafter_no_serving_engine_feeds_correctly_is_not_exported(tmp_path, layers):
    """vLLM, SGLang and TensorRT-LLM hand captured layers over distinct and ascending."""
    drafter = Eagle3Drafter(Eagle3Config.from_target(tiny_config(num_layers=8), capture_layers=layers))
    (tmp_path / "hf").mkdir()
    with pytest.raises(ValueError, match=rf"captures target layers \[{', '.join(map(str, layers))}\]"):
        write_eagle3_hf(drafter, tmp_path / "hf")
    assert not any((tmp_path / "hf").iterdir())


def _published_folder(drafter: Eagle3Drafter, folder, maps: bool = True) -> None:
    """``drafter`` laid out as SafeAILab publishes EAGLE-3 drafters (e.g. EAGLE3-LLaMA3.1-Instruct-8B):
    a plain Llama config.json with the Eagle3 architecture and draft_vocab_size, no eagle_config and
    none of our keys; fp16 weights in pytorch_model.bin, the target's embedding included."""
    c = drafter.config.layer
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id, "hidden_act": "silu", "hidden_size": c.hidden_size,
        "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1, "pad_token_id": 0,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "tie_word_embeddings": False,
        "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": c.vocab_size, "draft_vocab_size": drafter.config.draft_vocab_size}))
    state = {k: v.half() if v.is_floating_point() else v for k, v in drafter.state_dict().items()
             if maps or k not in ("d2t", "t2d")}
    state["embed_tokens.weight"] = torch.randn(c.vocab_size, c.hidden_size).half()
    torch.save(state, folder / "pytorch_model.bin")


@pytest.mark.parametrize("full_vocab", [False, True], ids=["draft-vocab", "full-vocab-no-maps"])
def test_published_folder_imports_with_the_target(tmp_path, capsys, full_vocab):
    from nemo_tlt.model.hf_io import save_hf_folder
    from nemo_tlt.model.lm import DecoderLM

    cfg = tiny_config(num_layers=8, num_heads=4, num_kv_heads=2)
    drafter = Eagle3Drafter(Eagle3Config.from_target(cfg), generator=torch.Generator().manual_seed(1)) \
        if full_vocab else _drafter()
    _published_folder(drafter, tmp_path / "hf", maps=not full_vocab)
    save_hf_folder(DecoderLM(cfg), tmp_path / "target")
    args = ["--from", "eagle3-hf", "--to", "drafter", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "d")]
    assert main(args) == 2
    assert "--target" in capsys.readouterr().err and not (tmp_path / "d").exists()
    assert main([*args, "--target", str(tmp_path / "target")]) == 0
    back = load_drafter(tmp_path / "d")
    # the serving engines' default captures for an 8-layer target: vLLM's (2, 4, 5) are our (1, 3, 4)
    assert back.capture_layers == (1, 3, 4)
    saved = load_file(str(tmp_path / "d" / "drafter.safetensors"))  # the file's fp16, bit for bit
    assert set(saved) == set(drafter.state_dict())
    assert all(torch.equal(v.half() if v.is_floating_point() else v, saved[k]) for k, v in drafter.state_dict().items())
    # a target it was not made for is refused
    save_hf_folder(DecoderLM(tiny_config(num_layers=8, hidden_size=64)), tmp_path / "other")
    assert main([*args, "--target", str(tmp_path / "other"), "--overwrite"]) == 2
    assert "hidden_size" in capsys.readouterr().err
