"""The embedded engine's row bookkeeping after a decode step: append the emitted tokens
(`commit_tokens`), find the rows that are done (`done_rows`), hand the finished rows
their results and drop them from the batch (`retire_rows`). Every value stays on the
device except where `retire_rows` reads the finished rows back (see nemo_tlt.model.host)."""
from __future__ import annotations

import torch

from nemo_tlt.model.host import host_list
from nemo_tlt.model.kv_cache import fill_holes_order_host
from nemo_tlt.rollout.protocol import FinishSink, RequestResult
from nemo_tlt.rollout.row_batch import RowBatch
from nemo_tlt.speculative.sampling import SamplingParams


def commit_tokens(batch: RowBatch, emitted: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor,
                  sampling: SamplingParams, eos: int) -> torch.Tensor:
    """Append each row's emitted tokens and their log-probs (cut at EOS or the token
    budget); the KV cache was already advanced by `counts`. Returns the tokens kept per row [B]."""
    B, W = emitted.shape
    cols = torch.arange(W, device=emitted.device)
    L_old = batch.lengths.clone()
    budget = sampling.max_new_tokens - batch.num_gen
    n = torch.minimum(counts, budget)
    if sampling.stop_on_eos:
        is_eos = (emitted == eos) & (cols[None, :] < n[:, None])
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, n)
        n = torch.minimum(n, first_eos)
    slots = (L_old[:, None] + 1 + cols).clamp(max=batch.tokens.shape[1] - 1)
    write = cols[None, :] < counts[:, None]
    cur = batch.tokens.gather(1, slots)
    batch.tokens.scatter_(1, slots, torch.where(write, emitted.clamp(min=0), cur))
    batch.logprobs.scatter_(1, slots, torch.where(write, logprobs, batch.logprobs.gather(1, slots)))
    batch.lengths = L_old + counts
    batch.num_gen = batch.num_gen + n
    return n


def done_rows(batch: RowBatch, sampling: SamplingParams, eos: int) -> torch.Tensor:
    """[B] bool: the rows that hit EOS or their token budget."""
    done = batch.num_gen >= sampling.max_new_tokens
    if sampling.stop_on_eos:
        b_idx = torch.arange(batch.rows.numel(), device=batch.tokens.device)
        done |= batch.tokens[b_idx, batch.prompt_len + batch.num_gen - 1] == eos
    return done


def retire_rows(batch: RowBatch, done: torch.Tensor, any_done: bool, longest: int, sampling: SamplingParams,
                eos: int, results: list, return_hidden: bool, on_finish: FinishSink | None = None) -> None:
    """Hand the finished rows their results and drop them (`longest`: the longest
    committed length of the rows that stay). Reads the finished rows' bookkeeping, then
    their tokens and log-probs together, back (two syncs): both as float64, exact for
    token ids (< 2**53) and fp32 log-probs."""
    if not any_done:
        return
    # every row's flag and bookkeeping in one read (no data-dependent nonzero() on the device)
    info = torch.stack((done.long(), batch.rows, batch.prompt_len, batch.num_gen), 1)
    rows_done = [(b, row, P, G) for b, (d, row, P, G) in enumerate(host_list(info)) if d]
    fin = torch.tensor([b for b, _, _, _ in rows_done], dtype=torch.long, device=done.device)
    width = max(P + G for _, _, P, G in rows_done)
    token_rows, logprob_rows = host_list(torch.stack((batch.tokens[fin, :width].double(),
                                                      batch.logprobs[fin, :width].double())))
    for (b, row, P, G), toks, lps in zip(rows_done, token_rows, logprob_rows):
        hidden = batch.features[b, : P + G - 1].clone() if return_hidden else None
        out = [int(t) for t in toks[P: P + G]]
        results[row] = RequestResult(out, "eos" if sampling.stop_on_eos and out[-1] == eos else "length",
                                     hidden, lps[P: P + G])
    finished = {b for b, _, _, _ in rows_done}
    batch.select(fill_holes_order_host([b not in finished for b in range(batch.rows.numel())]), longest)
    if on_finish is not None:  # after the batch is consistent again: the sink may take its time
        for _, row, _, _ in rows_done:
            on_finish(row, results[row])


def longest_running(batch: RowBatch, done: torch.Tensor) -> torch.Tensor:
    """The longest committed length among the rows not done (0 if none), on the device."""
    return torch.where(done, 0, batch.lengths).max()
