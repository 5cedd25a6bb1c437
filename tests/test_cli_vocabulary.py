"""One vocabulary across the subcommands: the same flag names for the same thing, the
old spellings kept as hidden aliases that still parse, every shared flag's default
stated in its help, and conflicting flags refused with one line naming both."""

from __future__ import annotations

import argparse
import json

import pytest

from pipesim.cli import build_parser, main, subparsers_of

# canonical long flag -> the short form it must carry wherever it appears
SHORT_FORMS = {"--microbatches": "-m", "--virtual-stages": "-v"}
# retired spelling -> the canonical flag that replaced it
ALIASES = {"--dp-bucket-mb": "--bucket-mb", "--layout": "--layers-per-stage"}
# flags shared by the simulator and the executor commands: named and documented alike
SHARED = ("--schedule", "--schedule-file", "--pp", "--microbatches", "--virtual-stages", "--dp", "--tp",
          "--bucket-mb", "--layers-per-stage")


def parsers() -> dict[str, argparse.ArgumentParser]:
    return {parser.prog: parser for parser in subparsers_of(build_parser())}


def visible(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string ``--help`` lists, to its action."""
    return {option: action for action in parser._actions if action.help != argparse.SUPPRESS
            for option in action.option_strings}


def test_shared_flags_have_one_name_a_short_form_and_a_stated_default():
    found = {flag: [] for flag in SHARED}
    for prog, parser in parsers().items():
        options = visible(parser)
        for flag in SHARED:
            if flag not in options:
                continue
            action = options[flag]
            found[flag].append(prog)
            if flag in SHORT_FORMS and prog != "pipesim plan":  # plan takes a list of v's to search
                assert SHORT_FORMS[flag] in action.option_strings, (prog, flag)
            assert "default" in action.help, (prog, flag, action.help)
        for retired in ALIASES:
            assert retired not in options, f"{prog} lists the retired spelling {retired}"
    # each shared flag is in both families: the simulator's and the executor's
    for flag in ("--pp", "--microbatches", "--virtual-stages", "--bucket-mb", "--layers-per-stage"):
        assert "pipesim simulate" in found[flag] and "pipesim run" in found[flag], (flag, found[flag])


@pytest.mark.parametrize("prog", ["simulate", "run", "compare"])
@pytest.mark.parametrize("retired", sorted(ALIASES))
def test_retired_spellings_still_parse_to_the_same_value(prog, retired):
    parser = build_parser()
    canonical = ALIASES[retired]
    value = "1,3" if canonical == "--layers-per-stage" else "7.5"
    old = parser.parse_args([prog, retired, value])
    new = parser.parse_args([prog, canonical, value])
    assert vars(old) == vars(new)
    dest = parser._subparsers._group_actions[0].choices[prog]._option_string_actions[canonical].dest
    assert str(getattr(new, dest)) == value


def test_every_listed_flag_that_takes_a_value_states_its_default():
    for prog, parser in parsers().items():
        for action in parser._actions:
            if (not action.option_strings or action.required or action.help == argparse.SUPPRESS
                    or action.nargs == 0):
                continue
            assert "default" in action.help, (prog, action.option_strings, action.help)
        parser.format_help()  # every help string still formats (no stray %)


def test_profile_lists_no_output_flags_it_would_ignore():
    options = visible(parsers()["pipesim profile"])
    for flag in ("--json", "--trace", "--steps", "--lr", "--weight-decay", "--inject-failure"):
        assert flag not in options
    assert "--out" in options


def test_run_defaults_to_three_steps_so_the_chart_is_warm():
    args = build_parser().parse_args(["run"])
    assert args.steps == 3


def one_line_error(capsys, argv) -> str:
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, flag, other", [
    (["simulate", "--costs", "{costs}", "--fwd", "0.1"], "--fwd", "--costs"),
    (["simulate", "--costs", "{costs}", "--bwd", "0.1"], "--bwd", "--costs"),
    (["sweep", "--costs", "{costs}", "--act-bytes", "10", "--quiet"], "--act-bytes", "--costs"),
    (["simulate", "--model", "llama3-8b", "--fwd", "0.1"], "--fwd", "--model llama3-8b"),
    (["simulate", "--schedule", "1f1b", "-v", "2"], "--virtual-stages 2", "--schedule 1f1b"),
    (["run", "--schedule", "gpipe", "-v", "3"], "--virtual-stages 3", "--schedule gpipe"),
    (["profile", "-v", "2", "--out", "{tmp}/c.json"], "--virtual-stages 2", "--schedule 1f1b"),
    (["simulate", "--schedule-file", "{csv}", "--pp", "4"], "--pp", "--schedule-file"),
    (["run", "--schedule-file", "{csv}", "-m", "4"], "--microbatches", "--schedule-file"),
])
def test_conflicting_flags_are_one_line_naming_both(capsys, tmp_path, argv, flag, other):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"stages": [{"fwd": 1.0, "bwd": 2.0}]}))
    csv = tmp_path / "s.csv"
    csv.write_text("0F0,1F0,1B0,0B0\n".replace(",", "\n"))  # unused unless parsed: conflicts come first
    argv = [arg.format(costs=costs, csv=csv, tmp=tmp_path) for arg in argv]
    line = one_line_error(capsys, argv)
    assert f"{flag} conflicts with {other}" in line.replace(f" {costs}", "").replace(f" {csv}", ""), line


def test_mfu_without_a_model_is_refused(capsys):
    line = one_line_error(capsys, ["simulate", "--mfu", "0.4"])
    assert "--mfu needs --model" in line


def test_zero_virtual_stages_is_an_error_not_the_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--schedule", "interleaved-1f1b", "-v", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--virtual-stages/-v: must be >= 1, got 0" in err and "Traceback" not in err


def test_costs_with_flags_alike_give_the_same_step(capsys, tmp_path):
    """The conflict rule refuses only what would be ignored: a costs file equal to the
    flags' uniform costs simulates to the same step (1F1B pp=4 m=8: (m + pp - 1)(F + B))."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"stages": [{"fwd": 1.0, "bwd": 2.0}]}))
    for argv in (["--costs", str(costs)], ["--fwd", "1", "--bwd", "2"]):
        out_json = tmp_path / "out.json"
        assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", *argv, "--json", str(out_json)]) == 0
        capsys.readouterr()
        assert json.loads(out_json.read_text())["makespan"] == pytest.approx((8 + 4 - 1) * 3.0)


def test_compare_refuses_costs_profiled_on_another_model(capsys, tmp_path):
    """A costs file whose meta names another width is refused before any rank starts."""
    costs = tmp_path / "costs.json"
    meta = {"source": "pipesim profile", "model": "mlp", "layers": 4, "hidden": 256, "pp": 2, "virtual_stages": 1,
            "dtype": "float32", "microbatch_size": 2}
    costs.write_text(json.dumps({"stages": [{"stage": 0, "fwd": 1e-3, "bwd": 2e-3},
                                            {"stage": 1, "fwd": 1e-3, "bwd": 2e-3}], "meta": meta}))
    line = one_line_error(capsys, ["compare", "--pp", "2", "-m", "4", "--batch-size", "8", "--hidden", "32",
                                   "--costs", str(costs), "--topology", "nvlink"])
    assert "profiled on another model or shape" in line
    assert "hidden 256 (this run: 32)" in line
    assert "microbatch_size" not in line  # 8 / 4 = 2, as profiled


def test_compare_costs_check_reads_the_profile_shape():
    from executor.options import config_from_args
    from pipesim.cli.compare import check_costs_match, profiled_shape

    args = build_parser().parse_args(["compare", "--pp", "2", "-m", "4", "--batch-size", "8", "--hidden", "32"])
    config = config_from_args(args)
    shape = profiled_shape(config)
    assert shape["microbatch_size"] == 2 and shape["hidden"] == 32 and shape["pp"] == 2
    check_costs_match(dict(shape), config, "same.json")  # the same shape passes
    check_costs_match({}, config, "hand-written.json")  # no meta: taken as it is
    with pytest.raises(ValueError, match="layers 8 \\(this run: 4\\)"):
        check_costs_match({**shape, "layers": 8}, config, "other.json")


def test_gpt_names_the_same_model_in_simulate_and_run():
    """``--model gpt`` in simulate is the transformer run trains: its parameter count
    matches torch's count of the executor's model, but for the head's bias (the spec,
    like Megatron's count, takes the head as its matrix only: ``vocab`` fewer)."""
    from executor.config import RunConfig
    from executor.models import build_model
    from executor.options import config_from_args
    from pipesim.job import Job, model_spec_of

    sizes = ["--layers", "3", "--hidden", "32", "--heads", "4", "--seq-len", "8", "--vocab", "50"]
    spec = model_spec_of(Job.from_namespace(build_parser().parse_args(["simulate", "--model", "gpt", *sizes])))
    run_args = build_parser().parse_args(["run", "--model", "gpt", *sizes])
    config = RunConfig(schedule="1f1b", pp=1, microbatches=1, model="gpt", layers=run_args.layers,
                       hidden=run_args.hidden, heads=run_args.heads, seq_len=run_args.seq_len, vocab=run_args.vocab,
                       batch_size=1)
    stage = build_model(config).build_stage(0, 1)
    torch_count = sum(parameter.numel() for parameter in stage.parameters())
    assert spec.total_params() + 50 == torch_count
    # with no size flags both take run's defaults
    default_spec = model_spec_of(Job.from_namespace(build_parser().parse_args(["simulate", "--model", "gpt"])))
    defaults = config_from_args(build_parser().parse_args(["run", "--model", "gpt"]))
    assert (default_spec.layers, default_spec.hidden, default_spec.heads, default_spec.seq_len, default_spec.vocab) == (
        defaults.layers, defaults.hidden, defaults.heads, defaults.seq_len, defaults.vocab)


def test_mlp_is_refused_by_the_simulator_with_what_to_use(capsys):
    line = one_line_error(capsys, ["simulate", "--model", "mlp"])
    assert "--model mlp" in line and "--model gpt" in line


@pytest.mark.parametrize("executor_command", ["run", "profile", "compare"])
def test_simulator_and_executor_default_to_the_same_pipeline(executor_command):
    from executor.options import config_from_args
    from pipesim.job import Job, schedule_of

    simulated = schedule_of(Job.from_namespace(build_parser().parse_args(["simulate"])))
    extra = ["--out", "c.json"] if executor_command == "profile" else []
    config = config_from_args(build_parser().parse_args([executor_command, *extra]))
    assert (config.schedule, config.pp, config.microbatches, config.virtual_stages) == (
        simulated.name, simulated.pp, simulated.microbatches, simulated.virtual_stages) == ("1f1b", 4, 8, 1)


def test_dtype_is_one_flag_in_simulate_and_run(capsys):
    """``--dtype NAME`` in simulate as in run; the old ``--dtype-bytes N`` still works,
    is not listed, and both together are a conflict."""
    from pipesim.job import Job, model_spec_of

    parser = build_parser()
    assert "--dtype" in visible(parsers()["pipesim simulate"]) and "--dtype" in visible(parsers()["pipesim run"])
    assert "--dtype-bytes" not in visible(parsers()["pipesim simulate"])
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float64", 8)):
        by_name = model_spec_of(Job.from_namespace(parser.parse_args(["simulate", "--model", "gpt",
                                                                      "--dtype", dtype])))
        by_size = model_spec_of(Job.from_namespace(parser.parse_args(["simulate", "--model", "gpt",
                                                                      "--dtype-bytes", str(size)])))
        assert by_name.dtype_bytes == by_size.dtype_bytes == size
    line = one_line_error(capsys, ["simulate", "--model", "gpt", "--dtype", "float32", "--dtype-bytes", "2"])
    assert "--dtype-bytes conflicts with --dtype float32" in line
