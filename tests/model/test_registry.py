"""``kvflow.model.registry``: what an unsupported ``model_type`` is told."""

from __future__ import annotations

import pytest

from kvflow.model import registry


def test_an_unsupported_model_type_names_every_supported_one():
    """The message listed the registered model_types only, not the multimodal ``gemma3``
    whose language model kvflow runs (docs/models.md)."""
    with pytest.raises(ValueError) as exc:
        registry.check_supported("gpt2")
    message = str(exc.value)
    assert message.startswith("model_type 'gpt2' is not supported; kvflow runs ")
    for model_type in registry.supported_model_types():
        assert repr(model_type) in message
    assert "the language model of ['gemma3']" in message
