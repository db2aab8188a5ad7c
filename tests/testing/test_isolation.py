"""What one test may leave behind for the next: the CPU backend patched into this process.

Tests that start distributed work in the pytest process itself (the fake-CUDA step's parallel state,
the bootstrap's own tests) install the CPU backend here. Left installed, it corrupts what later tests
load: transformers 5 builds a Llama's rotary frequencies with ``torch.tensor`` wrapped and leaves them
uninitialised, so an exported model's logits drift from Megatron's (0.10 seen in a shuffled order).
The suite's module-scoped autouse fixture (tests/conftest.py) removes it when the module that installed
it ends (``compat.remove``); this test does the same step by hand.
"""

from __future__ import annotations

import torch

from megatron_lev import compat
from megatron_lev.distributed import destroy_distributed, init_distributed


def _tiny_llama(root):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root)
    return _inv_freq(model).clone()  # built in an unpatched process: the reference


def _inv_freq(model):
    (buf,) = [b for n, b in model.named_buffers() if n.endswith("rotary_emb.inv_freq")]
    return buf


def test_in_process_distributed_work_leaves_torch_unpatched_for_hugging_face(tmp_path):
    from transformers import AutoModelForCausalLM

    want = _tiny_llama(tmp_path)
    assert not compat.is_applied()
    setup = init_distributed(tp=1, pp=1, backend="gloo", timeout_minutes=1)
    assert compat.is_applied() == (not torch.cuda.is_available())  # the CPU backend, as in a rank
    destroy_distributed(setup)
    if compat.is_applied():
        compat.remove()  # what the suite's fixture does when the module ends
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(_inv_freq(model), want, rtol=0, atol=0)
    assert not hasattr(torch.tensor, "__megatron_lev_original__")


def test_the_cpu_backend_comes_off_whole():
    originals = {n: getattr(torch, n) for n in ("empty", "tensor", "arange")}
    to, cuda_current = torch.Tensor.to, torch.cuda.current_device
    compat.apply(force=True)
    try:
        from megatron_lev.compat import cpu

        from ..conftest import _TORCH_ATTRS

        # The suite's per-test check (conftest._torch_as_it_was) watches every torch attribute the backend patches.
        patched = {(o, n) for o, n, _ in cpu._SAVED if not o.__name__.startswith("megatron")}
        assert patched <= set(_TORCH_ATTRS), patched - set(_TORCH_ATTRS)
        assert torch.tensor is not originals["tensor"] and torch.Tensor.to is not to
        assert torch.empty(2, device="cuda").device.type == "cpu"  # redirected while applied
    finally:
        compat.remove()
    assert {n: getattr(torch, n) for n in originals} == originals
    assert torch.Tensor.to is to and torch.cuda.current_device is cuda_current
    assert not compat.is_applied()
    compat.remove()  # a second removal is a no-op


def test_device_contexts_build_on_their_device_after_the_cpu_backend_comes_off():
    """torch caches the factories a ``with torch.device(...)`` context redirects at its first use; used
    first while the backend's wrappers were installed (a Hugging Face model loaded in a process that ran an
    in-process evaluation), the cache left the real factories out after ``remove``, and transformers then
    built the next model on the CPU with garbage rotary buffers (a flaky logits mismatch far from the cause)."""
    from torch.utils._device import _device_constructors

    _device_constructors.cache_clear()
    compat.apply(force=True)
    try:
        with torch.device("meta"):
            torch.empty(1)  # the first use: the cache is filled with the wrappers
    finally:
        compat.remove()
    assert torch.empty in _device_constructors()
    with torch.device("meta"):
        assert torch.empty(2).device.type == "meta" and torch.zeros(2).device.type == "meta"
