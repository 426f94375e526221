"""The training run: `python -m model train --config acc --out DIR [--minutes M | --steps N]`.

Each step draws its data from the generator (seed, step): one batch of packed arithmetic problems and
one batch of retrieval sequences of a length drawn from the curriculum, the loss being the mean
cross-entropy over answer tokens of each task (summed). AdamW, warm-up then cosine. The run's
progress is step / steps with --steps (reproducible), else training seconds / (60 x minutes): the
schedule follows the time budget whatever the machine's speed. The last `qat_frac` of progress trains
quantization-aware (model/train/net.py). After every step the noaux_tc correction biases move toward
balance (K3Train.balance).

State (parameters, optimizer, step, seconds trained) goes to DIR/state.pt every `save_every_s` and
when the run stops; `--resume` continues from it (the device machine's commands end at 10 minutes:
`--stop-after` seconds stops a call early, cleanly, and the next call resumes). At the end: DIR/fp32.safetensors
(FP32 master weights), DIR/checkpoint/ (the official MXFP4 layout, model/train/export.py, with tasks.json naming the tasks),
DIR/train_log.jsonl (one line per logged step and per held-out probe) and DIR/summary.json.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from model.config import config_from_dict
from model.train.config import TrainConfig
from model.train.net import K3Train
from model.train.tasks import arith_batch, question_set, retrieval_batch


def lr_at(tc: TrainConfig, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / max(1, tc.warmup))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return tc.lr * warm * (tc.min_lr_frac + (1 - tc.min_lr_frac) * cos)


def ret_length(tc: TrainConfig, rng: np.random.Generator, progress: float) -> int:
    """A retrieval length: log-uniform in [len_min, cap], cap from len_start to len_max over len_ramp."""
    f = min(1.0, progress / tc.len_ramp) if tc.len_ramp > 0 else 1.0
    cap = tc.len_start * (tc.len_max / tc.len_start) ** f
    return int(round(math.exp(rng.uniform(math.log(tc.len_min), math.log(max(cap, tc.len_min))))))


def masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(mean cross-entropy over the masked targets, token accuracy there)."""
    lg, tg = logits[mask], targets[mask]
    return F.cross_entropy(lg, tg), float((lg.argmax(-1) == tg).float().mean())


def _t(x: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


class Trainer:
    def __init__(self, tc: TrainConfig, out, device="cpu", init: dict[str, torch.Tensor] | None = None,
                 init_from: str | None = None):
        """init: canonical tensors to start from (a finished run's weights, `--init`) instead of the
        seeded initialization; the optimizer and the schedule start afresh."""
        self.tc, self.out, self.device = tc, Path(out), torch.device(device)
        self.init_from = init_from
        self.cfg = config_from_dict(tc.model)
        self.net = K3Train(self.cfg, seed=tc.seed, tensors=init, chunk=tc.chunk, sub=tc.sub).to(self.device)
        if init is None and tc.tied_init and not self.cfg.tie_embeddings:
            with torch.no_grad():
                e = self.net.w("model.embed_tokens.weight")
                self.net.w("lm_head.weight").copy_(e * e.shape[1] ** -0.5)
        decay = {id(p) for p in self.net.matrices()}
        params = [p for p in self.net.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW([{"params": [p for p in params if id(p) in decay], "weight_decay": tc.weight_decay},
                                      {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}],
                                     lr=tc.lr, betas=tc.betas)
        self.step, self.seconds = 0, 0.0
        self.probes = question_set(tc.probe_questions, tc.task, lengths=(1024,), seed=0x9_12_0BE) \
            if tc.probe_questions else []

    # -- state -------------------------------------------------------------------------------------
    def save_state(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "state.pt.tmp"
        torch.save({"name": self.tc.name, "net": self.net.state_dict(), "opt": self.opt.state_dict(),
                    "step": self.step, "seconds": self.seconds, "init_from": self.init_from}, tmp)
        tmp.replace(self.out / "state.pt")

    def load_state(self) -> None:
        s = torch.load(self.out / "state.pt", map_location=self.device, weights_only=True)
        if s["name"] != self.tc.name:
            from k3gen.errors import SpecError
            raise SpecError("--resume", str(self.out), [s["name"]], "the state was trained with another config")
        self.net.load_state_dict(s["net"])
        self.opt.load_state_dict(s["opt"])
        self.step, self.seconds = s["step"], s["seconds"]
        self.init_from = s.get("init_from")

    def log(self, rec: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "train_log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    # -- one step ----------------------------------------------------------------------------------
    def train_step(self, progress: float) -> dict:
        tc, dev = self.tc, self.device
        rng = np.random.default_rng([tc.seed, self.step])
        lr = lr_at(tc, self.step, progress)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.net.qat = tc.qat_frac > 0 and progress >= 1.0 - tc.qat_frac
        self.opt.zero_grad(set_to_none=True)
        rec = {"step": self.step, "lr": lr, "qat": self.net.qat}
        loads = None
        x, y, m = arith_batch(rng, tc.arith_seqs, tc.arith_per_seq, tc.task)
        loss_a, acc_a = masked_ce(self.net(_t(x, dev)), _t(y, dev), _t(m, dev))
        loss_a.backward()
        loads = [l.clone() for l in self.net.loads]
        rec.update(loss_arith=float(loss_a.detach()), acc_arith=acc_a, tokens=int(x.size))
        if tc.ret_tokens:
            L = ret_length(tc, rng, progress)
            q = tc.ret_queries if not tc.ret_query_every else max(1, min(tc.ret_queries, L // tc.ret_query_every))
            x, y, m = retrieval_batch(rng, max(1, tc.ret_tokens // L), L, q, tc.task)
            loss_r, acc_r = masked_ce(self.net(_t(x, dev)), _t(y, dev), _t(m, dev))
            loss_r.backward()
            loads = [a + b for a, b in zip(loads, self.net.loads)]
            rec.update(loss_ret=float(loss_r.detach()), acc_ret=acc_r, ret_len=L, tokens=rec["tokens"] + int(x.size))
        rec["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.net.parameters(), tc.clip))
        self.opt.step()
        self.net.loads = loads
        self.net.balance(tc.balance_rate)
        return rec

    def preflight(self, T: int = 96) -> float:
        """On a GPU, before training: the forward on this device (FP32, no TF32) against
        model/reference.py's Fp32Reference on the CPU, same weights, one sequence; the relative RMS
        difference of the logits (the CPU tests bound it at 2e-5). Raises if it exceeds 1e-4."""
        from model.reference import Fp32Reference
        toks = torch.randint(0, self.cfg.vocab, (1, T), generator=torch.Generator().manual_seed(1))
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            with torch.no_grad():
                got = self.net(toks.to(self.device))[0].double().cpu()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        want = Fp32Reference(self.cfg, self.net.tensors()).prefill(toks[0]).double()
        err = float((got - want).norm() / want.norm())
        if not err <= 1e-4:
            from k3gen.errors import K3genError
            raise K3genError(f"preflight: the training forward on {self.device} differs from the FP32 reference "
                             f"by {err:.2e} (relative RMS of the logits; the CPU tests see ~3e-6)")
        return err

    def probe(self) -> dict:
        """Teacher-forced exact match on held-out questions of a separate probe stream."""
        from model.eval.fp32 import teacher_forced_chunked
        res = teacher_forced_chunked(self.net, self.probes, self.device)
        by = {}
        for q, (ok, _) in zip(self.probes, res):
            by.setdefault(q.task, []).append(ok)
        return {k: sum(v) / len(v) for k, v in by.items()}

    # -- the run -----------------------------------------------------------------------------------
    def run(self, minutes: float | None = None, steps: int | None = None, stop_after: float | None = None,
            echo=print, stop_at_step: int | None = None) -> dict:
        tc = self.tc
        if (minutes is None) == (steps is None):
            from k3gen.errors import SpecError
            raise SpecError("--minutes/--steps", (minutes, steps), "exactly one of them")
        if self.device.type == "cuda":
            err = self.preflight()
            echo(f"preflight: logits on {torch.cuda.get_device_name()} vs the FP32 reference on the CPU: {err:.2e}")
            self.log({"step": self.step, "preflight_rel_rms": err})
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        def progress() -> float:
            return self.step / steps if steps is not None else self.seconds / (60.0 * minutes)

        call_start = time.perf_counter()
        last_save = last_probe = self.seconds
        stopped = "done"
        while progress() < 1.0:
            if (stop_after is not None and time.perf_counter() - call_start > stop_after) or \
                    (stop_at_step is not None and self.step >= stop_at_step):
                stopped = "stop-after"
                break
            t0 = time.perf_counter()
            rec = self.train_step(progress())
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.seconds += dt
            self.step += 1
            rec.update(step=self.step, seconds=round(self.seconds, 3), step_s=round(dt, 4),
                       progress=round(progress(), 5))
            if self.device.type == "cuda":
                rec["max_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if self.step % tc.log_every == 0 or self.step == 1:
                self.log(rec)
                echo(_line(rec))
            if self.probes and self.seconds - last_probe >= tc.probe_every_s:
                last_probe = self.seconds
                p = {"step": self.step, "seconds": round(self.seconds, 1), "probe": self.probe()}
                self.log(p)
                echo(f"probe at step {self.step}: {p['probe']}")
            if self.seconds - last_save >= tc.save_every_s:
                last_save = self.seconds
                self.save_state()
        self.save_state()
        summary = {"config": tc.name, "steps": self.step, "seconds": round(self.seconds, 1), "stopped": stopped,
                   "device": str(self.device), "init": self.init_from,
                   "settings": {k: v for k, v in dataclasses.asdict(tc).items() if k != "model"}}
        if stopped == "done":
            summary.update(self.finish())
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def finish(self) -> dict:
        """The FP32 master weights and the exported checkpoint; a final probe (QAT weights)."""
        from model.train.export import export_checkpoint, save_fp32
        t = self.net.tensors()
        save_fp32(t, self.out / "fp32.safetensors")
        ck = export_checkpoint(t, self.cfg, self.tc.model, self.out / "checkpoint",
                               metadata={"trained_steps": self.step, "train_config": self.tc.name})
        (ck / "tasks.json").write_text(json.dumps(dataclasses.asdict(self.tc.task), indent=1))
        out = {"checkpoint": str(self.out / "checkpoint")}
        if self.probes:
            self.net.qat = True
            out["final_probe"] = self.probe()
            self.log({"step": self.step, "final_probe": out["final_probe"]})
        return out


def _line(r: dict) -> str:
    s = f"step {r['step']:>6} {r['seconds']:>8.1f}s lr {r['lr']:.2e} arith {r['loss_arith']:.4f}/{r['acc_arith']:.3f}"
    if "loss_ret" in r:
        s += f" ret@{r['ret_len']} {r['loss_ret']:.4f}/{r['acc_ret']:.3f}"
    return s + f" |g| {r['grad_norm']:.2f} {r['tokens'] / r['step_s']:.0f} tok/s" + (" qat" if r["qat"] else "")


__all__ = ["Trainer", "lr_at", "ret_length", "masked_ce"]
