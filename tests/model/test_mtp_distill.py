"""The MTP head's training objectives in scripts/train_demo_model.py (--mtp-target teacher, --mtp-chain,
--mtp-self-share), on the real demo model in transformers: the distillation target is the main model's distribution
one position ahead of the draft's input token, the chained draft takes the previous pass's output as h and the token
after, and the self-generated continuations are the main model's greedy tokens with exactly those marked as targets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import train_demo_model as tdm  # noqa: E402  (scripts/ is on the path: tests/conftest.py)

DEMO = Path(__file__).resolve().parents[2] / "coli" / "demo" / "model"


@pytest.fixture(scope="module")
def main_model():
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    m = transformers.GlmMoeDsaForCausalLM.from_pretrained(DEMO).float().eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(DEMO / "tokenizer.json"))


def _kl64(teacher: np.ndarray, student: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(softmax(teacher) || softmax(student)) per row in float64, and the magnitude of its summed terms (for the
    float32 error bound)."""
    t = teacher.astype(np.float64)
    s = student.astype(np.float64)
    lp = t - t.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = s - s.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    p = np.exp(lp)
    return (p * (lp - lq)).sum(-1), (p * (np.abs(lp) + np.abs(lq))).sum(-1)


def _batch(tok):
    text = ("It returns the current process's mode. The module provides functions for working with paths, "
            "files and directories, and it is part of the Python standard library.")
    ids = tok.encode(text).ids[:24]
    b = torch.tensor([ids, ids[::-1]])                                           # [2, 24]
    t = torch.ones_like(b, dtype=torch.bool)
    t[1, :10] = False                                                            # a prompt part that is not trained
    return b, t


def test_teacher_and_chained_losses_target_the_main_models_next_positions(main_model, tok):
    # float64 throughout, so the implementation and the reference differ only by summation order
    # (torch's grouped-mm experts take no float64: the eager experts)
    main64 = transformers.GlmMoeDsaForCausalLM.from_pretrained(DEMO, dtype=torch.float64,
                                                               experts_implementation="eager").eval()
    torch.manual_seed(0)
    draft = tdm.MtpDraft(main64).double().eval()
    for m in draft.layer.modules():
        if getattr(m, "config", None) is not None:
            m.config._experts_implementation = "eager"
    batch, targets = _batch(tok)
    B, T = batch.shape
    with torch.no_grad():
        got1 = tdm.mtp_loss(main64, draft, batch, targets, target="teacher").item()
        got2 = tdm.mtp_loss(main64, draft, batch, targets, target="teacher", chain=1, chain_weight=1.0).item()
        # the reference, written from how decoding drafts: the main model's logits over the whole row (its own
        # forward), draft 1 at i from (h_i, t_{i+1}) judged on the main model's distribution after t_{i+1} (logits
        # row i+1); draft 2 at i from (g1_i, t_{i+2}) judged on logits row i+2
        logits_main = main64(input_ids=batch, use_cache=False).logits.numpy()    # [B, T, V]: row j = dist of t_{j+1}
        h = main64.model(input_ids=batch, use_cache=False).last_hidden_state     # [B, T, H] final-normed
        emb = main64.model.embed_tokens(batch)
        want, mags, weights = {1: [], 2: [], "late": []}, {1: [], 2: []}, {1: [], 2: [], "late": []}
        for b in range(B):
            g1, q1 = draft(emb[b:b + 1, 1:T - 1], h[b:b + 1, :T - 2])            # rows i = 0..T-3
            kl, mag = _kl64(logits_main[b, 1:T - 1], q1[0].numpy())
            want[1].append(kl); mags[1].append(mag); weights[1].append(targets[b, 2:].numpy())
            want["late"].append(_kl64(logits_main[b, 2:T], q1[0].numpy())[0])   # one position too far
            weights["late"].append(targets[b, 2:].numpy())
            _, q2 = draft(emb[b:b + 1, 2:T - 1], g1[:, :T - 3])                  # rows i = 0..T-4
            kl, mag = _kl64(logits_main[b, 2:T - 1], q2[0].numpy())
            want[2].append(kl); mags[2].append(mag); weights[2].append(targets[b, 3:].numpy())
    mean = {j: float((np.concatenate(want[j]) * np.concatenate(weights[j])).sum() / np.concatenate(weights[j]).sum())
            for j in (1, 2, "late")}
    # summation-order error: eps64 x the terms' magnitude x the depth of the sums (V per KL row, a few hundred
    # products per logit through 5 layers) -- far below any misalignment's effect, checked below
    bound = {j: np.finfo(np.float64).eps * float(np.concatenate(mags[j]).max()) * 1e5 for j in (1, 2)}
    assert abs(got1 - mean[1]) <= bound[1], (got1, mean[1], bound[1])
    assert abs(got2 - (mean[1] + mean[2])) <= bound[1] + bound[2], (got2, mean, bound)
    # a misaligned teacher (the distribution one position further) gives a clearly different value
    assert abs(mean["late"] - mean[1]) > 1e3 * bound[1]


def test_self_generated_stream_is_the_main_models_greedy_continuation(main_model, tok):
    chats = [[{"role": "user", "content": "What does os.path.join do?"},
              {"role": "assistant", "content": "It joins paths."}],
             [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"},
              {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "What is json?"},
              {"role": "assistant", "content": "A module."}],
             [{"role": "user", "content": "What does str.split do?"},
              {"role": "assistant", "content": "It splits."}]]
    new = 6
    stream, stats = tdm.self_generated_stream(main_model, tok, chats, n_prompts=3, new_tokens=new, seed=1, batch=2)
    assert stats["prompts"] == 3 and stats["tokens"] == len(stream)
    ids, mask, starts = stream.ids.tolist(), stream.targets.tolist(), stream.starts.tolist() + [len(stream)]
    assert len(starts) == 4
    prompts = {tuple(tok.encode(tdm.render_chat(c[:i], add_generation_prompt=True)).ids)
               for c in chats for i, m in enumerate(c) if m["role"] == "assistant"}
    with torch.no_grad():
        for s, e in zip(starts, starts[1:]):
            row = ids[s:e]
            n = len(row) - new
            assert tuple(row[:n]) in prompts                                     # cut from a given chat, before a reply
            assert mask[s:e] == [False] * n + [True] * new                       # only the generated tokens are trained
            seq = row[:n]
            for _ in range(new):                                                 # greedy without a KV cache
                seq.append(int(main_model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            assert seq == row
