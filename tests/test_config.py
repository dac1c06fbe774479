"""The typed `tlt` config: YAML + key=value merge, clear refusals naming the key,
the demo config, and the run-folder checks of `nemo-tlt train`."""
from __future__ import annotations

from pathlib import Path

import pytest

from nemo_tlt.config import TLTConfig, load_config
from nemo_tlt.rl.run import RunSpec, prepare_run_dir
from nemo_tlt.train import main, parse_argv
from nemo_tlt.speculative.tree_shape import TreeShape

DEMO = Path(__file__).resolve().parents[1] / "conf" / "demo.yaml"


def test_demo_yaml_loads_and_overrides_win():
    cfg = load_config(DEMO, ["grpo.group_size=8", "rollout.learned.arms=['4_2_8']", "run_dir=/x/y"])
    assert isinstance(cfg, TLTConfig)
    assert cfg.grpo.group_size == 8 and cfg.run_dir == "/x/y"
    assert cfg.rollout.learned.arms == (TreeShape(4, 2, 8),)  # parsed once, at the boundary
    assert cfg.workers.num_workers == 2 and cfg.grpo.acceptance == "coupled"


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(DEMO, ["steps=3", "drafter.trainer.max_steps_per_round=5",
                             "rollout.bandit.arms=['8_4_32','2_1_2']", "policy.optim.betas=[0.8,0.9]"])
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    assert load_config(saved) == cfg


def test_baseline_turns_off_sd_and_drafter_training_only():
    cfg = load_config(DEMO)
    base = cfg.baseline()
    assert not base.rollout.sd_enabled and not base.drafter.train_on_idle
    assert base.grpo == cfg.grpo and base.seed == cfg.seed and base.task == cfg.task


@pytest.mark.parametrize("override, key", [
    ("grpo.bogus=1", "grpo.bogus"),
    ("nonsense=3", "nonsense"),
    ("steps=abc", "steps"),
    ("policy.optim.lr=fast", "policy.optim.lr"),
    ("policy.separate_logprob_pass=maybe", "policy.separate_logprob_pass"),
    ("grpo.lr=1e-5", "grpo.lr"),  # moved to policy.optim.lr: the old key is refused, not ignored
    ("rollout.learned.bogus=1", "rollout.learned.bogus"),
])
def test_unknown_keys_and_wrong_types_name_the_key(override, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        load_config(DEMO, [override])


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  group_size: 4\n  groupsize: 8\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*'grpo\.groupsize'"):
        load_config(bad)


@pytest.mark.parametrize("override, message", [
    ("grpo.group_size=-4", r"grpo\.group_size must be >= 1"),
    ("grpo.group_size=0", r"grpo\.group_size must be >= 1"),
    ("rollout.threshold.threshold_on=0", r"rollout\.threshold\.threshold_on must be an int >= 1"),
    ("rollout.threshold.threshold_off=4", r"rollout\.threshold\.threshold_off=4 must be >= threshold_on=8"),
    ("rollout.threshold.reward=tokens", r"rollout\.threshold\.reward must be one of scaled, per_row, throughput"),
    ("rollout.sd_policy=oracle", r"rollout\.sd_policy must be one of threshold, learned"),
    ("grpo.acceptance=nucleus", r"grpo\.acceptance must be one of \['greedy', 'rejection', 'coupled'\]"),
    ("policy.clip_eps=1.5", r"policy\.clip_eps"),
    ("policy.optim.lr=0", r"policy\.optim\.lr must be > 0"),
    ("policy.tensor_parallel=2", r"policy\.tensor_parallel"),
    ("grpo.temperature=0", r"grpo\.temperature"),
    ("rollout.bandit.arms=['8_4']", r"rollout\.bandit\.arms\[0\]: malformed tree shape"),
    ("rollout.learned.arms=[4_2_8]", r"rollout\.learned\.arms\[0\]=428: .*quote each arm"),
    ("rollout.learned.arms=['4_2_8','4_2_8']", r"rollout\.learned\.arms\[1\]=4_2_8 duplicates arms\[0\]"),
    ("rollout.bandit.epsilon=2", r"rollout\.bandit\.epsilon"),
    ("rollout.learned.min_pulls=40", r"rollout\.learned\.min_pulls must be in \[1, 16\]"),
    ("rollout.learned.collapse_accept=0.5", r"rollout\.learned\.collapse_accept must be >= 1"),
    ("drafter.min_idle_workers=3", r"drafter\.min_idle_workers=3 exceeds workers\.num_workers=2"),
    ("drafter.harvest_from=disk", r"drafter\.harvest_from must be one of rollout, policy"),
    ("drafter.trainer.optim.lr=0", r"drafter\.trainer\.optim\.lr must be > 0"),
    ("drafter.trainer.batch_size=0", r"drafter\.trainer\.batch_size must be >= 1"),
    ("workers.num_workers=0", r"workers\.num_workers"),
    ("workers.start_method=thread", r"workers\.start_method"),
    ("task.reward=nowhere", r"task\.reward must be an import path"),
    ("task.source=csv", r"task\.source must be 'jsonl', 'datasets' or an import path"),
    ("task.tokenizer=bpe", r"task\.tokenizer must be 'hf' or an import path"),
    ("checkpoint.keep_last=0", r"checkpoint\.keep_last"),
    ("drafter.nice=25", r"drafter\.nice must be in \[0, 19\]"),
    ("model.target_dir=/somewhere", r"model\.target_dir and model\.drafter_dir must be given together"),
    ("rollout.engine=sglang", r"rollout\.engine must be one of \['torch', 'trtllm', 'vllm'\] or an import path"),
    ("model.dtype=float16", r"model\.dtype must be one of"),
    ("workers.device=tpu", r"workers\.device must be one of"),
])
def test_bad_values_are_refused_with_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(DEMO, [override])


def test_unwritable_checkpoint_dir_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cfg = load_config(DEMO, [f"checkpoint.dir={blocker / 'ckpt'}"])
    spec = RunSpec(cfg, "tlt", str(tmp_path / "run"), "unused", "unused")
    with pytest.raises(ValueError, match=r"checkpoint\.dir=.*cannot write checkpoints"):
        prepare_run_dir(spec)
    ok = RunSpec(load_config(DEMO), "baseline", str(tmp_path / "run"), "unused", "unused")
    assert prepare_run_dir(ok) == tmp_path / "run" / "checkpoints" and ok.checkpoint_dir.is_dir()


def test_cli_refuses_bad_usage_and_config(capsys, tmp_path):
    assert main([str(DEMO), "grpo.group_size=-1"]) == 2
    assert "grpo.group_size must be >= 1" in capsys.readouterr().err
    assert main([str(DEMO), "grpo.nope=1"]) == 2
    assert "'grpo.nope'" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown option"):
        parse_argv([str(DEMO), "--fast"])
    with pytest.raises(ValueError, match="first argument must be the config file"):
        parse_argv(["steps=3", str(DEMO)])
    args = parse_argv([str(DEMO), "steps=2", "--compare-baseline"])
    assert (args.config, args.overrides, args.compare_baseline) == (str(DEMO), ["steps=2"], True)


# ---- Hydra / NeMo override grammar: +key=value, ++key=value, ~key ------------------------

def test_plus_adds_a_key_under_a_mapping_field():
    cfg = load_config(DEMO, ["+task.reward_options.format_bonus=0.25", "+task.options.extra.depth=2"])
    assert cfg.task.reward_options == {"format_bonus": 0.25}
    assert cfg.task.options["extra"] == {"depth": 2}


@pytest.mark.parametrize("override, message", [
    ("+grpo.bogus=1", r"'grpo\.bogus': cannot add: the typed config has no key 'bogus' in grpo"),
    ("+nonsense.deep=1", r"'nonsense\.deep': cannot add: the typed config has no key 'nonsense' in the top level"),
    ("++policy.optim.bogus=1", r"'policy\.optim\.bogus': cannot add"),
    ("+steps=3", r"'steps': cannot add: the key exists \(holds 8\); set it with steps=3 or use \+\+steps=3"),
    ("+task.options.name=arith", r"'task\.options\.name': cannot add: the key exists"),
])
def test_plus_is_refused_for_typed_and_existing_keys(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(DEMO, [override])


def test_plus_plus_adds_or_sets():
    cfg = load_config(DEMO, ["++steps=3", "++task.reward_options.format_bonus=0.5"])
    assert cfg.steps == 3 and cfg.task.reward_options == {"format_bonus": 0.5}


def test_tilde_drops_a_mapping_entry_and_resets_a_typed_field_to_its_default():
    assert load_config(DEMO).steps == 8  # demo.yaml sets it; the schema default is TLTConfig.steps
    cfg = load_config(DEMO, ["~steps", "~task.options.name", "rollout.bandit.epsilon=0.3", "~rollout.bandit"])
    assert cfg.steps == TLTConfig.steps
    assert "name" not in cfg.task.options and "tail_exponent" in cfg.task.options
    assert cfg.rollout.bandit == TLTConfig().rollout.bandit
    # overrides apply in order: add, then remove again
    cfg = load_config(DEMO, ["+task.reward_options.format_bonus=0.5", "~task.reward_options.format_bonus"])
    assert cfg.task.reward_options == {}
    assert load_config(DEMO, ["~steps=8"]).steps == TLTConfig.steps  # removed only if it holds that value


@pytest.mark.parametrize("override, message", [
    ("~grpo.bogus", r"override '~grpo\.bogus': config key 'grpo\.bogus': cannot remove: there is no such key"),
    ("~task.options.nope", r"'task\.options\.nope': cannot remove: there is no such key"),
    ("~steps=7", r"'steps': cannot remove: it holds 8, not 7"),
    ("~", r"malformed key ''"),
    ("+grpo..x=1", r"malformed key 'grpo\.\.x'"),
    ("steps", r"'steps' is not of the form key=value"),
    ("+steps", r"'\+steps' is not of the form \+key=value"),
    ("~steps.deep", r"'steps' is a value, not a block"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(DEMO, [override])


def test_vllm_takes_the_files_engine_overrides_and_the_command_line_wins():
    demo = load_config(DEMO)
    assert (demo.grpo.acceptance, demo.drafter.harvest_from) == ("coupled", "rollout")
    cfg = load_config(DEMO, ["rollout.engine=vllm"])
    assert (cfg.grpo.acceptance, cfg.drafter.harvest_from) == ("rejection", "policy")
    assert load_config(DEMO, ["rollout.engine=vllm", "grpo.acceptance=greedy"]).grpo.acceptance == "greedy"
    assert load_config(DEMO, ["rollout.engine=vllm", "rollout.engine=torch"]).grpo.acceptance == "coupled"
    # the engine is read from the merged config, as the run will have it
    assert load_config(DEMO, ["rollout.engine=vllm", "~rollout"]).grpo.acceptance == "coupled"
    assert load_config(DEMO, ["rollout.engine= vllm"]).grpo.acceptance == "rejection"
    assert "engine_overrides" not in cfg.to_dict()  # the run's config holds the values applied


@pytest.mark.parametrize("override, message", [
    ("grpo.acceptance=coupled", r"grpo\.acceptance=coupled with rollout\.engine=vllm"),
    ("drafter.harvest_from=rollout", r"drafter\.harvest_from=rollout with rollout\.engine=vllm"),
])
def test_what_vllm_cannot_do_is_refused_by_its_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(DEMO, ["rollout.engine=vllm", override])
    load_config(DEMO, ["rollout.engine=vllm", override, "rollout.sd_enabled=false", "drafter.train_on_idle=false",
                       "grpo.acceptance=rejection"])  # the baseline asks for neither


@pytest.mark.parametrize("block, message", [
    ("engine_overrides: {sglang: [a=1]}", r"engine_overrides\.sglang: not a rollout engine"),
    ("engine_overrides: {vllm: grpo.acceptance}", r"engine_overrides\.vllm must be a list of key=value"),
    ("engine_overrides: [vllm]", r"engine_overrides must be a mapping"),
    ("engine_overrides: {vllm: [rollout.engine=torch]}", r"engine_overrides\.vllm may not set rollout\.engine"),
])
def test_bad_engine_overrides_name_the_file_and_key(tmp_path, block, message):
    path = tmp_path / "run.yaml"
    path.write_text(f"steps: 2\n{block}\n")
    with pytest.raises(ValueError, match=f"{path}: " + message):
        load_config(path, ["rollout.engine=vllm"])
