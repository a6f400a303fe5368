"""`cpcompile plan`: a train YAML or a Hugging Face folder in, an explicit plan out (issue 52 item 1)."""
from __future__ import annotations

import os

import yaml

import cpcompile
from cpcompile.cli import main
from cp_harness import tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_qwen3_5_head_tail.yaml")


def test_a_train_yaml_gives_its_cp_and_the_plan_goes_to_a_file(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", EXAMPLE, "--seq-len", "32768", "--gdn-backend", "eager", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"cpcompile plan: wrote {out}\n"
    plan = cpcompile.load_plan(str(out))
    assert plan.cp_size == 2  # the YAML's accelerator.cp_size
    assert {(o.match, o.method.name) for o in plan.active_overrides()} == {("*.linear_attn", "p2p_head_tail"),
                                                                         ("*.self_attn", "head_tail")}


def test_a_hugging_face_folder_needs_cp_and_length(tmp_path, capsys):
    tiny_llama(0).config.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cpcompile plan: error: cpcompile plan: give --cp and --seq-len (a train YAML may give them instead)"]
    assert main(["plan", str(tmp_path), "--cp", "2", "--seq-len", "64"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"# Suggested by cpcompile for {tmp_path}: CP=2, 64 tokens")
    assert yaml.safe_load(text)["plan_overrides"][0]["inner_wrapper"] == "sdpa_hf"
