"""`nemo-tlt drafter train` end to end on a tiny target: the report, the drafter folder,
resume from a checkpoint, the EAGLE-3 export, and bad inputs refused with exit 2."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import nemo_tlt.first_drafter.run as run_module
from nemo_tlt.cli import main as cli_main
from nemo_tlt.convert import main as convert_main
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3_hf import read_eagle3_hf
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.first_drafter.data import encode_prompts, read_prompts
from nemo_tlt.model.hf_io import load_hf_folder, save_hf_folder
from nemo_tlt.speculative.tree_shape import TreeShape
from nemo_tlt.spot.checkpoint import CheckpointManager
from tiny import tiny_target

MAX_NEW_TOKENS, GEN_BATCH = 12, run_module.FirstDrafterConfig.gen_batch  # _args's, the CLI's default
REPORT_KEYS = {"mean_accept_len", "tree", "type", "seed", "steps", "samples", "train_prompts", "eval_prompts",
               "time_s", "resumed_from_step", "sampling", "train_pairs"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny demo-style target: the character tokenizer's vocabulary and special ids,
    marked as a demo warm start so `--tokenizer auto` picks that tokenizer."""
    tok = CharTokenizer()
    folder = tmp_path_factory.mktemp("target") / "target"
    model = tiny_target(vocab_size=tok.vocab_size, num_layers=4, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                        pad_token_id=0)
    save_hf_folder(model, folder)
    (folder / "warm_start.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("1+2=", "3-1+4=", "5+5-2=", "7-3=", "2+2+2=")))
    return path


def _args(target_dir, prompts, out, *extra):
    return ["drafter", "train", "--target", str(target_dir), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--responses", "2", "--steps", "4", "--batch-size", "4",
            "--checkpoint-every", "2", "--warmup-steps", "1", "--tree", "3_2_4", "--eval-fraction", "0.4",
            "--no-progress", *extra]


def test_end_to_end_report_and_drafter_folder(target_dir, prompts, tmp_path):
    out = tmp_path / "d"
    assert cli_main(_args(target_dir, prompts, out)) == 0
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report), REPORT_KEYS - set(report)
    assert (report["type"], report["tree"], report["steps"], report["resumed_from_step"]) == ("eagle", "3_2_4", 4, 0)
    assert (report["train_prompts"], report["eval_prompts"], report["samples"]) == (3, 2, 6)
    target = load_hf_folder(target_dir)
    drafter = load_drafter(out, target)
    assert drafter.kind == "eagle"
    # the folder's weights are the last checkpoint's, tensor for tensor (the trained drafter)
    with CheckpointManager(out / "checkpoints") as ckpt:
        last = ckpt.load()
    assert last.step == 4 and last.extra_state["optimizer"]["state"], "no optimizer state: nothing was trained"
    weights = drafter.state_dict()
    assert set(weights) == set(last.tensors)
    differ = [k for k in weights if not torch.equal(weights[k], last.tensors[k])]
    assert not differ, f"the folder's drafter is not the step-4 checkpoint's: {differ}"
    # ... which is not the initial drafter, and accepts more than it, measured the same way (greedy SD
    # with the report's tree) on the same prompts
    untrained = EagleDrafter(EagleConfig.from_target(target.config),
                             generator=torch.Generator().manual_seed(report["seed"]))
    assert any(not torch.equal(v, weights[k]) for k, v in untrained.state_dict().items()), \
        "the folder holds the initial drafter"
    ids = encode_prompts(CharTokenizer(), read_prompts(str(prompts), "prompt"), target, str(target_dir))
    shape = TreeShape.parse(report["tree"])

    def accept_len(d, rows):
        return run_module.measure(target, d, rows, shape, MAX_NEW_TOKENS, GEN_BATCH)["mean_accept_len"]

    trained_len, untrained_len = accept_len(drafter, ids), accept_len(untrained, ids)
    assert trained_len > untrained_len, (trained_len, untrained_len)
    # the report's figure is the folder's drafter on the held-back prompts
    assert report["mean_accept_len"] == accept_len(drafter, [ids[i] for i in report["eval_prompt_indices"]])


def test_resume_continues_from_the_checkpoint(target_dir, prompts, tmp_path, monkeypatch):
    out = tmp_path / "d"
    assert cli_main(_args(target_dir, prompts, out)) == 0
    whole = load_drafter(out).state_dict()
    # what a run killed after its step-2 checkpoint leaves behind
    for name in ("report.json", "drafter.json", "drafter.safetensors"):
        (out / name).unlink()
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    # and saved as the EAGLE-2 drafter's earlier name: the same kind, so the run resumes
    run = json.loads((out / "run.json").read_text())
    assert run["kind"] == "eagle"
    (out / "run.json").write_text(json.dumps({**run, "kind": "eagle2"}))

    def no_generation(*args, **kwargs):
        raise AssertionError("the stored responses should be reused, not generated again")

    monkeypatch.setattr(run_module, "generate_samples", no_generation)
    assert cli_main(_args(target_dir, prompts, out)) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["resumed_from_step"] == 2
    resumed = load_drafter(out).state_dict()
    # optimizer and generator state restored: the same weights as the uninterrupted run
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_partial_run_with_other_settings_and_finished_run_are_refused(target_dir, prompts, tmp_path, capsys):
    out = tmp_path / "d"
    assert cli_main(_args(target_dir, prompts, out)) == 0
    assert cli_main(_args(target_dir, prompts, out)) == 2
    assert "finished drafter" in capsys.readouterr().err
    (out / "report.json").unlink()
    assert cli_main(_args(target_dir, prompts, out, "--lr", "0.01")) == 2
    assert "lr" in capsys.readouterr().err


def test_eagle3_folder_exports_to_the_hf_layout(target_dir, prompts, tmp_path):
    out = tmp_path / "d3"
    assert cli_main(_args(target_dir, prompts, out, "--type", "eagle3")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["type"] == "eagle3"
    drafter = load_drafter(out, load_hf_folder(target_dir))
    assert drafter.kind == "eagle3" and drafter.config.ttt_steps == 3  # the tree's depth
    assert convert_main(["--from", "drafter", "--to", "eagle3-hf", "--input", str(out),
                         "--output", str(tmp_path / "hf")]) == 0
    back = read_eagle3_hf(tmp_path / "hf").state_dict()
    assert all(torch.equal(v, back[k]) for k, v in drafter.state_dict().items())


def test_bad_inputs_exit_2_naming_the_file_or_key(target_dir, prompts, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert cli_main(_args(missing, prompts, tmp_path / "a")) == 2
    assert str(missing) in capsys.readouterr().err

    keyless = tmp_path / "keyless.jsonl"
    keyless.write_text(json.dumps({"text": "1+2="}) + "\n")
    assert cli_main(_args(target_dir, keyless, tmp_path / "b")) == 2
    err = capsys.readouterr().err
    assert str(keyless) in err and "'prompt'" in err

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli_main(_args(target_dir, empty, tmp_path / "c")) == 2
    assert str(empty) in capsys.readouterr().err

    bare = tmp_path / "bare"
    shutil.copytree(target_dir, bare)
    (bare / "warm_start.json").unlink()
    assert cli_main(_args(bare, prompts, tmp_path / "e")) == 2
    assert "--tokenizer" in capsys.readouterr().err
    # nothing was left behind by the refused runs
    assert not any((tmp_path / name).exists() for name in "abce")


def test_hf_tokenizer_in_the_target_folder_and_its_chat_template(tmp_path):
    """`--tokenizer auto` takes the HF tokenizer saved beside the weights; `--chat-template`
    renders each prompt through it, as the RL loop's task.chat_template does."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.decoders import Fuse
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from transformers import PreTrainedTokenizerFast

    from nemo_tlt.first_drafter.data import load_samples

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate("0123456789+=#ua")}}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = Split("", behavior="isolated")
    raw.decoder = Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}{{ bos_token }}{{ m['role'][0] }}={{ m['content'] }}{% endfor %}" \
                        "{% if add_generation_prompt %}{{ bos_token }}a={% endif %}"
    folder = tmp_path / "target"
    save_hf_folder(tiny_target(vocab_size=len(vocab), bos_token_id=1, eos_token_id=2, pad_token_id=0), folder)
    tok.save_pretrained(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("1+2=", "3+4=", "5+6=")))
    assert cli_main(_args(folder, prompts, tmp_path / "d", "--chat-template")) == 0
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["tokenizer"].startswith("HFTokenizer(")
    samples = load_samples(tmp_path / "d" / "data" / "samples.safetensors")
    rendered = [tok.encode(f"<s>u={p}<s>a=", add_special_tokens=False) for p in ("1+2=", "3+4=", "5+6=")]
    assert len(rendered[0]) == 10  # <s> u = 1 + 2 = <s> a =
    assert samples and all(s.tokens[:10].tolist() in rendered for s in samples)
