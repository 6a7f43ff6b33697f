"""`peagle generate`: text, statistics, and one-line errors."""
import json

from peagle_core.cli import main


def test_generate_prints_text_and_acceptance(capsys):
    rc = main(["generate", "--model", "tiny", "--drafter", "tiny-peagle", "--mode", "peagle", "--k", "3",
               "--prompt", "def add(a, b):", "--max-tokens", "8", "--device", "cpu", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= out["output_tokens"] <= 8 and out["k"] == 3 and out["num_drafts"] > 0
    assert out["acceptance_length"] >= 1.0 and len(out["outputs"]) == 1


def test_chat_reply_shows_only_the_final_channel(capsys):
    rc = main(["generate", "--prompt", "What is Python?", "--chat", "--max-tokens", "12", "--k", "3", "--json"])
    assert rc == 0
    text = json.loads(capsys.readouterr().out)["outputs"][0]
    assert text and not text.startswith("final")


def test_bad_input_is_one_line_and_exit_2(tiny_pair, capsys):
    rc = main(["generate", "--model", tiny_pair["target"], "--mode", "none", "--prompt", "x", "--max-tokens", "0"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_tokens" in err[0]
