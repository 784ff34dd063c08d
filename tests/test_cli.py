import json

import pytest

from eaglespec.cli import main


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from eaglespec.toy import make_toy_models

    return make_toy_models(tmp_path_factory.mktemp("toy"))


def test_generate_json_with_messages_and_ids(toy, tmp_path, capsys):
    target, draft = toy
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n"
        + json.dumps({"prompt_ids": [7, 8, 9]}) + "\n" + json.dumps({"prompt": "def f():"}) + "\n"
    )  # fmt: skip
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--input", str(inp), "--json",
               "--max-new-tokens", "6", "--batch-size", "2"])  # fmt: skip
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert lines[1]["prompt_ids"] == [7, 8, 9]
    for x in lines:
        assert 1 <= len(x["output_ids"]) <= 6 and "text" in x
        assert x["stats"]["new_tokens"] == len(x["output_ids"])
    # plain decoding gives the same greedy output (lossless)
    rc = main(["generate", "--target", str(target), "--input", str(inp), "--json", "--max-new-tokens", "6",
               "--mode", "off"])  # fmt: skip
    plain = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["output_ids"] for x in plain] == [x["output_ids"] for x in lines]


def test_streaming_prints_text_and_summary(toy, capsys):
    target, draft = toy
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "import os",
                 "--max-new-tokens", "5", "--temperature", "0.8", "--seed", "3"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("import os") and "tau=" in out and "tokens/s=" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target", "/nonexistent/dir", "--prompt", "x"], "does not exist"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--prompt", "x", "--top-p", "0"], "top_p"),
        (["--prompt", "x", "--top-k", "-2"], "top_k"),
        (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", "x", "--batch-size", "0"], "batch_size"),
        (["--prompt", "x", "--draft-prefill-window", "-3"], "prefill window"),
        (["--input", "/nonexistent.jsonl"], "does not exist"),
        ([], "--prompt"),
    ],
)
def test_bad_input_is_a_clear_error_not_a_traceback(toy, capsys, args, needle):
    target, _ = toy
    full = ["generate", "--target", str(target), *args] if "--target" not in args else ["generate", *args]
    assert main(full) == 2
    err = capsys.readouterr().err
    assert "eaglespec: error:" in err and needle in err and "Traceback" not in err


def test_malformed_jsonl_and_mismatched_drafter(toy, tmp_path, capsys):
    target, draft = toy
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    assert main(["generate", "--target", str(target), "--input", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    from eaglespec.settings import default_models_dir

    real = default_models_dir() / "target"
    if (real / "config.json").is_file():  # toy drafter (vocab 1K) against the default target (8K)
        assert main(["generate", "--target", str(real), "--draft", str(draft), "--prompt", "hi"]) == 2
        assert "does not fit the target" in capsys.readouterr().err
