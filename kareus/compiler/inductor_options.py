"""``torch.compile``'s ``mode=`` and ``options=`` as kareus takes them.

``options`` may mix Inductor's config options with kareus's Config fields
(:func:`split_options`); a mode becomes Inductor's config patches, as under torch.compile
(:func:`inductor_options`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kareus.compiler.config import Config
from kareus.errors import ConfigError


def split_options(
    options: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``torch.compile``'s ``options=`` into Inductor's and kareus's Config fields.

    Raises:
        ConfigError: an option is neither a Config field nor an Inductor config option.
    """
    import dataclasses

    if not options:
        return {}, {}
    if not isinstance(options, Mapping):
        raise ConfigError(
            "options", options, "a dict of Inductor options or Config fields", owner=""
        )
    fields = {f.name for f in dataclasses.fields(Config)}
    ours = {k: v for k, v in options.items() if k in fields}
    inductor = {k: v for k, v in options.items() if k not in fields}
    if inductor:
        from kareus._torch_internals import inductor_config

        known = inductor_config().get_config_copy()
        unknown = sorted(k for k in inductor if k not in known)
        if unknown:
            raise ConfigError(
                "options",
                unknown,
                "Inductor config options (torch._inductor.config; see "
                "torch._inductor.list_options()) or kareus Config fields "
                f"({', '.join(sorted(fields))})",
                owner="",
            )
    return inductor, ours


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch.compile``'s modes, which kareus takes too (they configure Inductor)."""


def inductor_options(mode: str | None, options: dict[str, Any], codegen: str) -> dict[str, Any]:
    """Return the Inductor config patches of ``mode`` and ``options`` (as torch.compile).

    Raises:
        ConfigError: an unknown mode, both a mode and Inductor options (torch.compile
            refuses them together too), or either with ``codegen='python'``.
    """
    if mode is not None and mode not in MODES:
        raise ConfigError("mode", mode, f"one of {MODES} (torch.compile's modes)", owner="")
    if mode in (None, "default") and not options:
        return {}
    if codegen != "inductor":
        raise ConfigError(
            "mode" if mode not in (None, "default") else "options",
            mode if mode not in (None, "default") else options,
            "none with codegen='python': modes and Inductor options configure Inductor, "
            "which runs with codegen='inductor' (the default)",
            owner="",
        )
    if mode not in (None, "default") and options:
        raise ConfigError(
            "mode",
            mode,
            "either mode or Inductor options, not both (as torch.compile): put the "
            "mode's options (torch._inductor.list_mode_options(mode)) in options",
            owner="",
        )
    if options:
        return dict(options)
    from kareus._torch_internals import inductor_mode_options

    return inductor_mode_options(mode)
