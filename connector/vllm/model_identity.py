"""What names a vLLM model to the handshake: its architecture and, where vLLM was given
one, its served model name; never the ``--model`` path.

Two copies of a model in two directories (or a hub id on one side and a local path on
the other) are the same model: the handshake compares what decides the KV cache
(:mod:`kvbridge.handshake.compat`), and the served model name stands for the weights
where the operator gave one (``--served-model-name``; a router sends requests by that
name, so a prefill and a decode behind it share it). ``extra.model_fingerprint`` takes
precedence over it (:class:`kvbridge.connector.worker.worker.ModelInfo`).
"""

from __future__ import annotations

from typing import Any


def architecture(model_config: Any) -> str:
    """The model class vLLM runs (``"LlamaForCausalLM"``); '' where it does not say."""
    arch = getattr(model_config, "architecture", "")
    if not arch:
        archs = getattr(model_config, "architectures", None) or ()
        arch = archs[0] if archs else ""
    return str(arch or "")


def served_fingerprint(model_config: Any) -> str:
    """The served model name, when vLLM was given one; '' when it is only the ``--model``
    argument again (vLLM's default), which differs between copies of a model."""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model = str(getattr(model_config, "model", ""))
    weights = str(getattr(model_config, "model_weights", "") or "")
    if not served or str(served) in (model, weights):
        return ""
    return str(served)
