import pytest

import kareus
from kareus import Config, ConfigError


def test_defaults_round_trip_through_json():
    cfg = Config(nanobatches=1, codegen="inductor", strict=True)
    assert Config.from_json(cfg.to_json()) == cfg
    assert Config.from_dict(Config().to_dict()) == Config()


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [
        ("nanobatches", 3, "1 (no split) or 2"),
        ("nanobatches", True, "1 (no split) or 2"),
        ("batch_dim", -1, "non-negative"),
        ("codegen", "tvm", "one of ('python', 'inductor')"),
        ("strict", "yes", "None, True or False"),
        ("disable_passes", ("no_such_pass",), "known passes"),
        ("disable_passes", "find_blocks", "a tuple of pass names"),
    ],
)
def test_bad_values_name_field_value_and_range(field, value, hint):
    with pytest.raises(ConfigError) as info:
        Config(**{field: value})
    msg = str(info.value)
    assert f"Config.{field}={value!r}" in msg and hint in msg
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_unknown_field_lists_the_fields_and_the_closest():
    with pytest.raises(ConfigError, match="the Config fields: .*nanobatches"):
        Config.from_dict({"nanobatch": 2})
    with pytest.raises(ConfigError, match=r"nanobatchs=2 .*\(did you mean nanobatches\?\)"):
        kareus.compile(lambda x: x, nanobatchs=2)
    with pytest.raises(ConfigError, match=r"\(did you mean clocks\?\)"):  # a compile option
        kareus.compile(lambda x: x, clock="auto")
    with pytest.raises(ConfigError) as err:
        kareus.compile(lambda x: x, zzz=1)
    assert "did you mean" not in str(err.value)


def test_replace_validates():
    assert Config().replace(nanobatches=1).nanobatches == 1
    with pytest.raises(ConfigError):
        Config().replace(nanobatches=0)


def test_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        Config(2)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Config().nanobatches = 1  # type: ignore[misc]


def test_describe_documents_every_field():
    text = Config.describe()
    for name in Config().to_dict():
        assert text.count(f"{name} (default") == 1


def test_the_compile_options_suggested_are_the_keywords_compile_takes():
    """COMPILE_OPTIONS (what a mistyped keyword may have meant, besides the Config fields)
    is the keywords of kareus.compile and KareusBackend: kept by hand in config.py, which
    sits below both, so checked here."""
    import inspect

    from kareus.compiler.config import COMPILE_OPTIONS

    taken = set()
    for fn in (kareus.compile, kareus.KareusBackend.__init__):
        taken |= {
            name
            for name, p in inspect.signature(fn).parameters.items()
            if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name == "config")
        }
    assert taken == set(COMPILE_OPTIONS)
