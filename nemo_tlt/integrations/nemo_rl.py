"""A NeMo-RL ``GenerationInterface`` adapter over a `RolloutEngine` with TLT's SD policy.

Held to ``nemo_rl/models/generation/interfaces.py`` as recorded in
``interface_facts.NEMO_RL_GENERATION`` (the commit read is named there and in
docs/nemo.md): ``generate(data, greedy)`` takes a GenerationDatumSpec (``input_ids``
[B, T] right-padded, ``input_lengths`` [B]) and returns a GenerationOutputSpec:
``output_ids`` [B, S] in the input's dtype (input followed by generation, right-padded
with ``pad_token_id``), ``generation_lengths`` and ``unpadded_sequence_lengths`` [B]
int64, ``logprobs`` [B, S] float32 and ``truncated`` [B] bool. Where NeMo-RL is
importable the output is its ``BatchedDataDict``; elsewhere a plain dict of the same
tensors.

``logprobs`` are the engine's (``RequestResult.logprobs``) in NeMo-RL's layout, as its
vLLM and SGLang backends write them: ``logprobs[b, P_b + i]`` is the log-prob of the
i-th generated token (``output_ids[b, P_b + i]``, P_b the prompt length), zeros over the
prompt and the padding. They are the sampling transform's (temperature, top-k, top-p),
or the raw log-softmax under ``greedy=True`` (``speculative.sampling.token_logprobs``);
NeMo-RL's policy computes its own at its temperature, so its ``token_mult_prob_error``
compares like with like when the generation temperature is the policy's and no top-k /
top-p is set.
``stop_strings`` in the datum is refused (the engines stop on EOS and length only).

Weights (NeMo-RL's refit, ``refit_policy_generation`` in ``nemo_rl/algorithms/grpo.py``):

* colocated (NeMo-RL's default, ``policy.generation.colocated.enabled: true``):
  ``update_weights_via_ipc_zmq`` receives the training rank's CUDA IPC stream over ZMQ
  (`nemo_rl_refit`, the protocol of NeMo-RL's own vLLM and TensorRT-LLM receivers) and loads
  it into the engine, in this process: the adapter must live in a process that sees the GPU
  it shares with the training rank (its NVML UUID names the socket: ``device_uuid``, or the
  current CUDA device's). It returns ``[]`` (nothing left to wait for) and raises on failure,
  after acknowledging the rest of the stream. One adapter serves one socket: every colocated
  training rank streams the whole model to the socket of its own GPU, so a run of more than
  one training GPU needs one adapter (and engine) per GPU; a rank whose socket nobody serves
  fails its refit after NeMo-RL's 120 s timeout. ``prepare_for_generation`` /
  ``finish_generation`` keep the engine's memory as it is (no sleep or offload during training).
* non-colocated (NCCL broadcast from the training ranks): refused by name in
  ``init_collective``, which NeMo-RL calls at setup, before any step: the adapter does not
  join NeMo-RL's NCCL group (a trainer waiting on it would hang).

Where NeMo-RL is importable the adapter subclasses its ``GenerationInterface``.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from nemo_tlt.adaptive.config import SpecDecodingConfig
from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.device import cuda_device_of_uuid, cuda_uuid
from nemo_tlt.integrations import nemo_rl_refit
from nemo_tlt.integrations.nemo_aligner import TLTBlock, build_engine
from nemo_tlt.rollout.protocol import PolicyWeights, Request, RolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams

log = logging.getLogger(__name__)

NON_COLOCATED_REFUSAL = (
    "TLTGeneration does not join NeMo-RL's NCCL refit group (non-colocated generation, "
    "policy.generation.colocated.enabled=false): run colocated, where weights arrive through "
    "update_weights_via_ipc_zmq")


def _interface_base() -> type:
    """NeMo-RL's ``GenerationInterface`` where NeMo-RL imports, else ``object``."""
    if importlib.util.find_spec("nemo_rl") is None:
        return object
    try:
        return importlib.import_module("nemo_rl.models.generation.interfaces").GenerationInterface
    except (ImportError, AttributeError):  # NeMo-RL present but not importable here (e.g. PyPI's placeholder)
        return object


def local_gpu_uuid(index: int | None = None) -> str:
    """The UUID of CUDA device ``index`` (default: the current one) in NVML's form, as NeMo-RL's
    ``nemo_rl.utils.nvml.get_device_uuid`` reads it: "GPU-" + the device properties' uuid."""
    if not torch.cuda.is_available():
        raise ValueError("TLTGeneration.device_uuid: no CUDA device here to read a GPU UUID from; pass device_uuid")
    index = torch.cuda.current_device() if index is None else index
    return cuda_uuid(index)


def rebuild_on(device: torch.device) -> Callable[[Any], torch.Tensor]:
    """NeMo-RL's ``rebuild_cuda_tensor_from_ipc`` onto ``device``: the sender's buffer there."""
    def rebuild(handle: Any) -> torch.Tensor:
        args = list(handle[0])
        args[6] = device.index
        return rebuild_cuda_tensor(*args)
    return rebuild


class TLTGeneration(_interface_base()):  # type: ignore[misc]
    def __init__(self, engine: RolloutEngine, sampling: SamplingParams, pad_token_id: int,
                 spec: SpecDecodingConfig | None = None, seed: int = 0, device_uuid: str | None = None,
                 rebuild: Callable[[Any], torch.Tensor] | None = None, policy: SpecPolicy | None = None) -> None:
        """``policy``: the SD policy (default: built from ``spec``, plain decoding without one).
        ``device_uuid``: the GPU shared with the training rank (default: the current CUDA
        device's); ``rebuild``: how a refit's IPC handle becomes a tensor (default: on that GPU)."""
        if sampling.mode == "greedy":
            raise ValueError("TLTGeneration.sampling is the non-greedy sampling; generate(greedy=True) selects greedy")
        if device_uuid is not None:
            nemo_rl_refit.socket_address(device_uuid)  # checked now, not at the first refit
        self.engine, self.sampling, self.pad_token_id = engine, sampling, pad_token_id
        if policy is None:
            policy = (spec or SpecDecodingConfig(sd_enabled=False)).build_policy(np.random.default_rng(seed))
        self.policy = policy
        self.device_uuid, self.rebuild = device_uuid, rebuild
        self.state_dict_info: dict[str, Any] | None = None
        self._socket: Any = None
        self._calls = 0
        self._warned_logprobs = False

    @classmethod
    def from_tlt_block(cls, tlt: TLTBlock, sampling: SamplingParams, pad_token_id: int, seed: int = 0,
                       **kwargs: Any) -> "TLTGeneration":
        """The engine ``tlt.backend`` names (``torch`` or ``trtllm``, as in the NeMo-Aligner
        backend), with ``tlt.rollout``'s SD policy (``kwargs``: ``device_uuid``, ``rebuild``)."""
        policy = tlt.rollout.build_policy(np.random.default_rng(seed))
        return cls(build_engine(tlt, policy), sampling, pad_token_id, policy=policy, **kwargs)

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list:
        """Refused (see the module docstring): NeMo-RL calls it at setup in non-colocated mode only."""
        raise ValueError(NON_COLOCATED_REFUSAL)

    def shutdown(self) -> bool:
        """Closes the refit socket; safe to call repeatedly."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        return True

    def generate(self, data: Mapping[str, torch.Tensor], greedy: bool = False) -> dict[str, torch.Tensor]:
        for key in ("input_ids", "input_lengths"):
            if key not in data:
                raise ValueError(f"generate: data has no {key!r} (GenerationDatumSpec keys: input_ids, input_lengths)")
        stop_strings = data.get("stop_strings") if isinstance(data, Mapping) else None
        if stop_strings is not None and any(s for s in stop_strings):
            raise ValueError("generate: data['stop_strings'] is not supported (the engines stop on EOS and "
                             "max_new_tokens only)")
        ids, lengths = data["input_ids"], [int(n) for n in data["input_lengths"]]
        requests = [Request(ids[b, :n].tolist(), seq_id=b) for b, n in enumerate(lengths)]
        mode = "greedy" if greedy else self.sampling.mode
        sampling = SamplingParams(**{**self.sampling.__dict__, "mode": mode, "seed": self.sampling.seed + self._calls})
        self._calls += 1
        out = self.engine.generate(requests, sampling, policy=self.policy)
        if out.logprobs_from != "engine" and not self._warned_logprobs:
            self._warned_logprobs = True
            log.warning("generate: the engine reports no log-probs in this configuration (%s: TensorRT-LLM with a "
                        "drafter); GenerationOutputSpec.logprobs holds NaN at the generated positions, so NeMo-RL's "
                        "token_mult_prob_error reads NaN; the policy's own prev_logprobs are unaffected",
                        out.logprobs_from)
        gen = torch.tensor([len(r.tokens) for r in out.results], dtype=torch.long)
        total = torch.tensor(lengths, dtype=torch.long) + gen
        output_ids = torch.full((len(requests), int(total.max())), self.pad_token_id, dtype=ids.dtype)
        logprobs = torch.zeros(output_ids.shape, dtype=torch.float32)  # zeros over prompts and padding
        for b, (req, res) in enumerate(zip(requests, out.results)):
            output_ids[b, :int(total[b])] = torch.tensor(list(req.prompt) + res.tokens, dtype=ids.dtype)
            logprobs[b, len(req.prompt): int(total[b])] = torch.tensor(res.logprobs, dtype=torch.float32)
        out_spec = {"output_ids": output_ids, "generation_lengths": gen, "unpadded_sequence_lengths": total,
                    "logprobs": logprobs,
                    "truncated": torch.tensor([r.stop_reason == "length" for r in out.results], dtype=torch.bool)}
        if importlib.util.find_spec("nemo_rl") is None:
            return out_spec
        return importlib.import_module("nemo_rl.distributed.batched_data_dict").BatchedDataDict(out_spec)

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        """``{HF name: (shape, dtype)}`` of what the refits send (NeMo-RL calls it once at setup)."""
        self.state_dict_info = {name: (torch.Size(shape), dtype) for name, (shape, dtype) in state_dict_info.items()}

    def update_weights_via_ipc_zmq(self) -> list:
        """Receive one colocated refit and load it (see the module docstring); ``[]`` when done.
        A socket error closes the socket (the next refit connects afresh)."""
        if self.state_dict_info is None:
            raise ValueError("update_weights_via_ipc_zmq: prepare_refit_info was not called (NeMo-RL calls it "
                             "at setup with the policy's {name: (shape, dtype)})")
        sock = self._refit_socket()
        import zmq  # present: the socket is one

        receiver = nemo_rl_refit.Receiver(sock.recv, sock.send, self.state_dict_info, self._rebuild_handle)
        try:
            try:
                self.engine.load_policy_weights(iter(receiver))
            finally:
                receiver.drain()  # the rest of the stream, after a failure (or nothing)
        except zmq.ZMQError:  # a timeout (zmq.Again) or a broken socket: the next refit connects afresh
            self.shutdown()
            raise
        return []

    def _rebuild_handle(self, handle: Any) -> torch.Tensor:
        if self.rebuild is None:
            self.rebuild = rebuild_on(cuda_device_of_uuid(self._uuid(), "update_weights_via_ipc_zmq"))
        return self.rebuild(handle)

    def _uuid(self) -> str:
        if self.device_uuid is None:
            self.device_uuid = local_gpu_uuid()
        return self.device_uuid

    def update_weights_from_collective(self) -> list:
        """Refused: see `init_collective`."""
        raise ValueError(NON_COLOCATED_REFUSAL)

    def update_weights(self, weights: PolicyWeights) -> bool:
        """Load canonical weights given directly (a state dict or a stream)."""
        self.engine.load_policy_weights(weights)
        return True

    def _refit_socket(self) -> Any:
        """The REP socket connected to the training rank's (made at the first refit, kept)."""
        if self._socket is None:
            try:
                import zmq  # lazy: pyzmq, the nemo-rl extra
            except ImportError as err:
                raise ImportError("update_weights_via_ipc_zmq needs pyzmq: pip install nemo-tlt[nemo-rl]") from err
            uuid = self._uuid()
            sock = zmq.Context.instance().socket(zmq.REP)
            sock.setsockopt(zmq.SNDTIMEO, nemo_rl_refit.TIMEOUT_MS)
            sock.setsockopt(zmq.RCVTIMEO, nemo_rl_refit.TIMEOUT_MS)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(nemo_rl_refit.socket_address(uuid))
            self._socket = sock
        return self._socket
