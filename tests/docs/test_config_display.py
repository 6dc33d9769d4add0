"""`megaopd config` shows the config as the job reads it (issue 54): the teachers list without the emptied
`teacher:` shorthand, `loss.config` with every key of the loss (its defaults included), and its output is
itself a preset that loads to the same config."""

import yaml

from megaopd.config.cli import config_main


def _config(capsys, *argv) -> str:
    assert config_main(list(argv)) == 0
    return capsys.readouterr().out


def test_config_shows_teachers_and_the_losss_defaults(capsys, tmp_path):
    out = _config(capsys, "examples/tiny/stable_opd.yaml")
    cfg = yaml.safe_load(out)
    assert "teacher" not in cfg and [t["name"] for t in cfg["teachers"]] == ["teacher"]
    loss = cfg["loss"]["config"]
    assert loss["sft_weight"] > 0 and "ref_kl_weight" in loss
    assert {"eps_low", "eps_high", "policy_loss"} <= set(loss["opd"])  # defaults the preset did not write
    # The output loads as a preset, to the same config.
    (tmp_path / "resolved.yaml").write_text(out)
    assert _config(capsys, str(tmp_path / "resolved.yaml")) == out


def test_a_preset_whose_files_are_missing_is_shown_with_one_warning(capsys):
    assert config_main(["examples/tiny/stable_opd.yaml", "data.sources=[{path: /nowhere/opd.jsonl}]"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["data"]["sources"][0]["path"] == "/nowhere/opd.jsonl"
    (line,) = captured.err.strip().splitlines()
    assert "warning: not there yet: data.sources[0].path=/nowhere/opd.jsonl" in line
    # --strict refuses it, as megaopd train does; and a setting the job refuses is refused even with files missing.
    assert config_main(["--strict", "examples/tiny/stable_opd.yaml", "data.sources=[{path: /nowhere/opd.jsonl}]"]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = ["examples/tiny/stable_opd.yaml", "data.sources=[{path: /nowhere/opd.jsonl}]", "student.tp=3"]
    assert config_main(bad) == 2
    assert "student.tp=3" in capsys.readouterr().err
