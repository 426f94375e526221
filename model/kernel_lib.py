"""The model's kernel ops: `k3gen::glu_act` and `k3gen::mla_prefill` now live in k3gen/library
(issue 24: every kernel an engine-facing `k3gen::` op); this module keeps the model's name for
their namespace so call sites read `K.ops.<op>`."""
from __future__ import annotations

import torch

import k3gen.library  # noqa: F401  (registers the k3gen:: ops)

ops = torch.ops.k3gen
