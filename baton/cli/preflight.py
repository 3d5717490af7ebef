"""What `baton` checks before it starts a process or a server: that the model can be served."""

from __future__ import annotations

from baton.runtime.settings import SettingsError


def check_model(model: str, revision: str | None = None, tokenizer: str | None = None,
                weights: bool = True, quantization: str | None = None) -> None:
    """SettingsError (one line, exit 2) when `model` (or `tokenizer`) names no files here or
    its checkpoint cannot be served (its config and every header checked, no weight read;
    the tokenizer's files only when not `weights`): before any process or server starts,
    not as a traceback from a worker's event loop."""
    from engine.dummy_models import dummy_model
    from engine.tokenizer import resolve_source

    try:
        if tokenizer is not None and dummy_model(tokenizer) is None:
            resolve_source(tokenizer, tokenizer_only=True)  # its repository's main: --revision is the model's
        if (dummy_model(model) is not None and quantization is None) or (not weights and tokenizer is not None):
            return
        if not weights:
            resolve_source(model, revision, tokenizer_only=True)
            return
        from engine.model.loader import inspect_model

        inspect_model(model, revision, quantization)
    except (OSError, ValueError) as error:  # FileNotFoundError, PermissionError; CheckpointError
        raise SettingsError(str(error)) from None
