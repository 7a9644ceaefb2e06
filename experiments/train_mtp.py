"""Train an MTP draft head (kvstream.model.mtp) for a frozen Qwen2 target; Hydra app.

    python -m experiments.train_mtp hardware=h200 steps=2000                     # the 0.5B on one H200
    python -m experiments.train_mtp model.source=/tmp/t.gguf seq_len=64 steps=300  # any GGUF, CPU

Data: ``seq_len``-token sequences of the Python sources of this interpreter (kvstream.eval.corpus),
train / held-out split by file; the run's ``steps x batch`` training sequences are tokenized up front,
in an order fixed by the seed. Each sequence: the target's forward pass under no_grad gives its
next-token distributions and the hidden states the head reads (``features``: the stream after its
last block, or several streams that the head fuses, EAGLE-3's low / middle / high; the target is never
trained); the head runs k
unrolled draft steps over it (``MTPHead.unroll``, EAGLE-3's training-time test) and the loss is the
mean over steps of KL(target || head), each row of step s against the target's distribution at the
position it predicts. With a draft vocabulary the target's distribution is restricted to those N
tokens and renormalised. Agreement: head argmax == target argmax, per step, on the held-out sequences.

Out: ``out`` (the head's GGUF, kvstream.model.mtp_gguf; its sha256 printed), ``<out>.curve.csv``
beside it (one row per evaluation), checkpoints in ``ckpt_dir`` (head, optimizer, schedule, step,
RNG, data position) from which ``resume`` continues exactly.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm import tqdm

from kvstream.cli import errors
from kvstream.config import Hardware, ModelSource, to_typed
from kvstream.eval.corpus import ROOTS, python_sources, split_files, token_sequences
from kvstream.model.loader import open_gguf
from kvstream.model.mtp import MTPHead
from kvstream.model.mtp_gguf import OUT_TYPES, write_head
from kvstream.model.qwen import Qwen, eagle3_features, load_model
from kvstream.model.qwen import features as features_checked
from kvstream.model.registry import resolve_model, sha256_file
from kvstream.model.tokenizer import Tokenizer

# knobs that do not change what is trained: a checkpoint resumes under other values of these
NOT_THE_RUN = ("out", "out_type", "ckpt_dir", "ckpt_every", "resume", "stop_after", "progress")


@dataclass
class TrainConfig:
    model: ModelSource = field(default_factory=ModelSource)
    hardware: Hardware = field(default_factory=Hardware)
    corpus: list[str] = field(default_factory=lambda: list(ROOTS))
    held_out: float = 0.02
    eval_seqs: int = 8
    seq_len: int = 2048
    batch: int = 4
    steps: int = 2000
    lr: float = 5e-4
    warmup: int = 50
    lr_min: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    unroll: int = 4
    ffn: int | None = None
    features: str = "last"  # the target states the head reads: last | eagle3 | block indices "2,14,25"
    draft_vocab: int = 0
    seed: int = 0
    eval_every: int = 100
    out: str = "/tmp/mtp/head.gguf"
    out_type: str = "f16"
    ckpt_dir: str | None = None
    ckpt_every: int = 200
    resume: bool = True
    stop_after: int | None = None
    progress: bool = True

    def __post_init__(self):
        if self.model.weights != "dense":
            raise ValueError(f"model.weights={self.model.weights}: the head trains against the dense target (the q8_0 "
                             "kernel has no backward pass); a head trained so drafts for a q8_0 target too")
        if self.unroll < 1 or self.seq_len < self.unroll + 2:
            raise ValueError(f"unroll={self.unroll}, seq_len={self.seq_len}: need unroll >= 1 and seq_len >= unroll + 2")
        for key in ("batch", "steps", "eval_seqs", "eval_every", "ckpt_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out={self.held_out}: the held-out fraction of files, in (0, 1)")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab={self.draft_vocab}: a number of tokens, or 0 for the full vocabulary")
        feature_layers(self.features, None)  # the form; the indices against the target at the start
        if self.out_type not in OUT_TYPES:
            raise ValueError(f"out_type={self.out_type!r}; choose one of {', '.join(OUT_TYPES)}")

    @property
    def ckpt_path(self) -> Path:
        return Path(self.ckpt_dir or self.out + ".ckpt") / "last.pt"

    def run_key(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_THE_RUN}


def feature_layers(spec: str, n_layers: int | None) -> tuple[int, ...] | None:
    """``features``: "last" (None: the stream after the last block, EAGLE-1 / DeepSeek-V3's MTP),
    "eagle3" (the streams entering blocks 2, n / 2 and n - 3), or comma-separated block indices
    (0..n_layers; n_layers: after the last block). ``n_layers`` None: the form only."""
    if spec == "last":
        return None
    if spec == "eagle3":
        if n_layers is None:
            return None
        taps = eagle3_features(n_layers)
        if len(set(taps)) < 3 or min(taps) < 0:
            raise ValueError(f"features=eagle3 taps the streams entering blocks 2, n/2 and n-3, which coincide or fall "
                             f"outside 0..{n_layers} for this target's {n_layers} blocks ({list(taps)}): use "
                             f"features=last or block indices")
    else:
        try:
            taps = tuple(int(i) for i in str(spec).split(","))
        except ValueError:
            raise ValueError(f"features={spec!r}: last, eagle3, or comma-separated block indices such as 2,14,25") from None
    return taps if n_layers is None else features_checked(n_layers, taps)


def target_pass(target: Qwen, tokens: torch.Tensor, features: bool | tuple[int, ...] = True) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T] -> the target's logits [T, vocab] (float32) and the states the head reads [T, F x d]
    (True: the stream after the last block; a tuple: the streams entering those blocks)."""
    cache = target.new_cache(tokens.shape[0])
    with torch.no_grad():
        return target.body(tokens, cache.begin(tokens.shape[0]), cache, all_logits=True, hidden=features)


def sequence_loss(head: MTPHead, target: Qwen, tokens: torch.Tensor, k: int, amp) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over the k steps of KL(target || head), head-target top-1 agreement per step [k])."""
    t_logits, h = target_pass(target, tokens, head.features)
    with torch.no_grad():
        p_log = F.log_softmax(t_logits if head.d2t is None else t_logits[:, head.d2t], -1)
        t_top = t_logits.argmax(-1)
    with amp:
        outs = head.unroll(h, tokens, k)
    loss = torch.stack([F.kl_div(F.log_softmax(q, -1), p_log[s:], reduction="batchmean", log_target=True)
                        for s, q in enumerate(outs, 1)]).mean()
    agree = torch.stack([(head.to_target(q.argmax(-1)) == t_top[s:]).float().mean() for s, q in enumerate(outs, 1)])
    return loss, agree.detach()


@torch.no_grad()
def evaluate(head: MTPHead, target: Qwen, seqs: torch.Tensor, k: int, amp) -> tuple[float, list[float]]:
    """Mean held-out loss and agreement per step over ``seqs`` [n, T]."""
    parts = [sequence_loss(head, target, s.to(target.device), k, amp) for s in seqs]
    return float(torch.stack([p[0] for p in parts]).mean()), torch.stack([p[1] for p in parts]).mean(0).tolist()


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``lr_min`` x lr at ``steps``."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr_min + (1 - cfg.lr_min) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def draft_vocabulary(seqs: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """The ``n`` most frequent target ids of ``seqs`` (ties: the lower id), sorted."""
    counts = torch.bincount(seqs.flatten(), minlength=vocab)
    if not 0 < n <= vocab:
        raise ValueError(f"draft_vocab={n}: must be in 1..{vocab} (the target's vocabulary), or 0 for all of it")
    return torch.sort(torch.argsort(-counts, stable=True)[:n]).values


def agreement(row: dict, k: int) -> str:
    return "/".join(f"{row[f'agree_{s + 1}']:.2f}" for s in range(k))


def write_curve(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def train(cfg: TrainConfig, command: str = "") -> dict:
    """Run the training; returns the per-step training losses of this call, the curve rows and, when
    the run finished, the GGUF path and sha256."""
    dev = torch.device(cfg.hardware.device)
    torch.manual_seed(cfg.seed)
    path = resolve_model(cfg.model.source)
    reader = open_gguf(path)
    tok = Tokenizer.from_gguf(reader)
    target = load_model(reader, cfg.hardware.torch_dtype, dev)
    amp = (torch.autocast("cuda", cfg.hardware.torch_dtype) if dev.type == "cuda" and cfg.hardware.dtype != "float32"
           else contextlib.nullcontext())
    train_files, held_files = split_files(python_sources(tuple(cfg.corpus)), cfg.held_out, cfg.seed)
    seqs = token_sequences(train_files, tok.encode, cfg.seq_len, cfg.steps * cfg.batch, tok.eos_id)
    held = token_sequences(held_files, tok.encode, cfg.seq_len, cfg.eval_seqs, tok.eos_id)
    d2t = draft_vocabulary(seqs, cfg.draft_vocab, target.cfg.vocab_size) if cfg.draft_vocab else None
    head = MTPHead(target, cfg.ffn, d2t, seed=cfg.seed, features=feature_layers(cfg.features, target.cfg.n_layers)).to(dev)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    step, curve, ckpt = 0, [], cfg.ckpt_path
    if cfg.resume and ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)  # RNG states must stay on the CPU
        if state["run"] != cfg.run_key():
            diff = {k: (v, cfg.run_key()[k]) for k, v in state["run"].items() if cfg.run_key()[k] != v}
            raise ValueError(f"{ckpt} belongs to another run ((checkpoint, now): {diff}); resume=false or another ckpt_dir")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, curve = state["step"], state["curve"]
        assert state["data_pos"] == step * cfg.batch
        torch.set_rng_state(state["rng"])
        if dev.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], dev)
    csv_path = Path(cfg.out).with_suffix(".curve.csv")
    csv_path.parent.mkdir(parents=True, exist_ok=True)

    def record(losses: list[float]) -> None:
        loss, agree = evaluate(head, target, held, cfg.unroll, amp)
        curve.append({"step": step, "tokens_seen": step * cfg.batch * cfg.seq_len, "lr": sched.get_last_lr()[0],
                      "train_loss": sum(losses) / len(losses) if losses else None, "heldout_loss": loss,
                      **{f"agree_{s + 1}": a for s, a in enumerate(agree)}})
        write_curve(csv_path, curve)

    def save() -> None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        state = {"run": cfg.run_key(), "head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                 "step": step, "data_pos": step * cfg.batch, "curve": curve, "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None}
        torch.save(state, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").replace(ckpt)  # a run killed mid-write keeps the previous checkpoint

    if not curve:
        record([])  # step 0: the untrained head
    losses, since_eval, t0 = [], [], time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, disable=not cfg.progress, desc="mtp", dynamic_ncols=True)
    end = min(cfg.steps, cfg.stop_after or cfg.steps)
    while step < end:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for b in range(cfg.batch):
            loss, _ = sequence_loss(head, target, seqs[step * cfg.batch + b].to(dev), cfg.unroll, amp)
            (loss / cfg.batch).backward()
            total += loss.item() / cfg.batch
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        losses.append(total)
        since_eval.append(total)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record(since_eval)
            since_eval = []
        if step % cfg.ckpt_every == 0 or step == end:
            save()
        bar.set_postfix(loss=f"{total:.3f}", heldout_agree=agreement(curve[-1], cfg.unroll))
        bar.update()
    bar.close()
    dt = time.perf_counter() - t0
    print(f"trained     {len(losses) * cfg.batch * cfg.seq_len:,} tokens in {dt:.1f} s "
          f"({len(losses) * cfg.batch * cfg.seq_len / dt:,.0f} tok/s, evaluations and checkpoints included)")
    result = {"losses": losses, "curve": curve, "csv": csv_path}
    if step == cfg.steps:
        corpus = (f"{','.join(cfg.corpus)}: {len(train_files)} train / {len(held_files)} held-out files, "
                  f"Python {platform.python_version()}")
        sha = write_head(cfg.out, head, sha256_file(path), {
            "command": command, "corpus": corpus, "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len,
            "steps": cfg.steps, "seed": cfg.seed}, cfg.out_type)
        print(f"head        {cfg.out}  sha256 {sha}\ncurve       {csv_path}\n"
              f"held-out    agreement per step {agreement(curve[-1], cfg.unroll)} after {step} steps")
        result |= {"gguf": Path(cfg.out), "sha256": sha}
    return result


@hydra.main(version_base=None, config_path="pkg://conf", config_name="train_mtp")
@errors.task
def _main(cfg: DictConfig) -> None:
    train(to_typed(cfg, TrainConfig), command=" ".join(["python -m experiments.train_mtp", *sys.argv[1:]]))


def main() -> None:
    errors.main("train_mtp", _main, lambda: "interrupted: the last checkpoint is kept; the same command resumes from it")


if __name__ == "__main__":
    main()
