"""The kernel checks of ``nemo-tlt selfcheck --gpu`` on the CPU: the random model is built in the
served dtype (a 7B model never passes through fp32), the probe names a kernel for each phase, and
verifying a chain as one block gives decode's logits."""
from __future__ import annotations

import dataclasses

import torch

from nemo_tlt.selfcheck import kernel_checks as kc
from nemo_tlt.selfcheck.cli import DRY_RUN_SIZES

CFG = DRY_RUN_SIZES.kernel_model


def test_the_random_model_is_built_in_the_served_dtype(monkeypatch):
    built = []

    class Recording(kc.DecoderLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append({p.dtype for p in self.parameters()})

    monkeypatch.setattr(kc, "DecoderLM", Recording)
    before = torch.get_default_dtype()
    model = kc.random_target(CFG, torch.device("cpu"), torch.bfloat16)
    assert built == [{torch.bfloat16}] and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == before
    again = kc.random_target(CFG, torch.device("cpu"), torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_the_probe_names_a_kernel_for_each_phase_and_verify_matches_decode():
    kernels = kc.sdpa_probe(CFG, torch.device("cpu"), torch.float32, 16)
    assert set(kernels) == {"prefill", "decode", "verify"}
    assert all(names and all(n.startswith("aten::") for n in names) for names in kernels.values()), kernels
    wide = dataclasses.replace(CFG, num_layers=3)
    out = kc.verify_vs_decode(wide, torch.device("cpu"), torch.float32, 16, chain=6)
    assert out["max_logit_diff"] < 1e-4 and out["argmax_agree_rate"] == 1.0
