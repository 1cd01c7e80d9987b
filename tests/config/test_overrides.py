"""Override parsing: every Hydra form verl scripts use, and errors that quote the override."""

import math

import pytest

from hybridrl.config import ConfigError
from hybridrl.config.overrides import parse_override, parse_value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("-3", -3),
        ("1_000", 1000),
        ("1e-6", 1e-6),
        ("1.0e-06", 1e-6),
        ("0.", 0.0),
        (".5", 0.5),
        ("3E2", 300.0),
        ("true", True),
        ("False", False),
        ("TRUE", True),
        ("null", None),
        ("Null", None),
        ("no", "no"),  # YAML 1.1 would make this False; Hydra keeps a string
        ("off", "off"),
        ("~/data/gsm8k/train.parquet", "~/data/gsm8k/train.parquet"),
        ("Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2-7B-Instruct"),
        ("'error'", "error"),
        ('"1e-6"', "1e-6"),
        ("'it\\'s'", "it's"),
        ("", ""),
        ("[console,file]", ["console", "file"]),
        ("['console','file']", ["console", "file"]),
        ("[ 'console' , \"file\" ]", ["console", "file"]),
        ("[]", []),
        ("[1, 2.5, null, true]", [1, 2.5, None, True]),
        ("[[1,2],[3]]", [[1, 2], [3]]),
        ("{a: 1, b: [x, y]}", {"a": 1, "b": ["x", "y"]}),
        ("{}", {}),
        ("['/home/u/data/gsm8k/train.parquet', 'hdfs://h/x.parquet']", ["/home/u/data/gsm8k/train.parquet", "hdfs://h/x.parquet"]),
        ("${data.max_response_length}", "${data.max_response_length}"),
        ("[${oc.select:a.b,1}, c]", ["${oc.select:a.b,1}", "c"]),
    ],
)
def test_parse_value(text, expected):
    value = parse_value(text)
    assert value == expected
    assert type(value) is type(expected)


def test_special_floats():
    assert math.isinf(parse_value("inf")) and math.isnan(parse_value("nan"))


@pytest.mark.parametrize(
    ("text", "op", "key", "value"),
    [
        ("a.b=1", "set", "a.b", 1),
        ("+a.b=1", "add", "a.b", 1),
        ("++a.b=x", "force", "a.b", "x"),
        ("~a.b", "delete", "a.b", None),
        ("~a.b=3", "delete", "a.b", 3),
        ("a.b=x=y", "set", "a.b", "x=y"),
        ("actor_rollout_ref.rollout.n=8", "set", "actor_rollout_ref.rollout.n", 8),
    ],
)
def test_parse_override(text, op, key, value):
    parsed = parse_override(text)
    assert (parsed.op, parsed.key, parsed.value) == (op, key, value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trainer.total_epochs", "missing '=value'"),
        ("=3", "is not a key path"),
        ("a b=3", "is not a key path"),
        ("trainer.logger=[console,file", "cannot parse the value"),
        ("trainer.logger=['console]", "unterminated"),
        ("x={a 1}", "cannot parse the value"),
        ("x=[a,]", "empty element"),
    ],
)
def test_parse_errors_quote_the_override(text, message):
    with pytest.raises(ConfigError) as err:
        parse_override(text)
    assert message in str(err.value) and repr(text) in str(err.value)
