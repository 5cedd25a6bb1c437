"""compare --costs-out / --topology-out / --schedule-out: what the prediction used, in the
files simulate reads, and the simulate command that gives the same step back."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster.comm_fit import FILE_COLLECTIVES
from pipesim.cluster.files import load_topology, save_topology, topology_from_dict, topology_to_dict

TINY = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--backend", "gloo", "--steps", "2",
        "--calibration-steps", "1", "--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2",
        "--seq-len", "8", "--batch-size", "4"]
REPRODUCE = "simulate this prediction"


def printed_command(out: str) -> list[str]:
    """The simulate arguments of compare's reproduce line (after ``pipesim``)."""
    (line,) = [line for line in out.splitlines() if line.startswith(REPRODUCE)]
    words = shlex.split(line.split(": ", 1)[1])
    assert words[:2] == ["pipesim", "simulate"]
    return words[1:]


@pytest.mark.timeout(300)
def test_simulate_with_the_printed_command_gives_compares_predicted_step(tmp_path, capsys):
    from executor.config import RunConfig, build_schedule
    from schedules.csv_io import schedule_from_csv

    paths = {name: tmp_path / name for name in ("compare.json", "costs.json", "links.json", "programs.csv")}
    assert main(["compare", *TINY, "--quiet", "--json", str(paths["compare.json"]),
                 "--costs-out", str(paths["costs.json"]), "--topology-out", str(paths["links.json"]),
                 "--schedule-out", str(paths["programs.csv"])]) == 0
    out = capsys.readouterr().out
    for path in paths.values():
        assert f"wrote {path}" in out
    document = json.loads(paths["compare.json"].read_text())
    command = printed_command(out)
    assert command[command.index("--p2p") + 1] == "buffered"  # gloo's semantics, which the run had
    assert main([*command, "--json", str(tmp_path / "simulated.json")]) == 0
    simulated = json.loads((tmp_path / "simulated.json").read_text())
    assert simulated["makespan"] == pytest.approx(document["predicted_step_time"], rel=1e-9, abs=0)
    # the costs file is the costs the prediction was made with, F, B, I, W per stage as read
    costs = json.loads(paths["costs.json"].read_text())
    assert costs == document["costs"]
    assert costs["meta"]["source"] == "calibration steps of the run"
    assert len(costs["stages"]) == 2 and all(stage["fwd"] > 0 and stage["bwd"] > 0 for stage in costs["stages"])
    # the programs are the ones the run ran: lowered before any cost was known
    ran = build_schedule(RunConfig(schedule="1f1b", pp=2, microbatches=2))
    assert schedule_from_csv(paths["programs.csv"]).programs == ran.programs
    # the links are the ones benchmarked on gloo (buffered P2P by default when read back)
    links = load_topology(str(paths["links.json"]))
    assert links.devices == ["rank0", "rank1"] and links.backend == "gloo"
    assert links.route("rank0", "rank1").bandwidth > 0


def test_without_the_programs_the_printed_command_is_checked_and_a_different_step_said(tmp_path, capsys):
    from pipesim.cli.calibration_files import reproduction_lines

    costs, links = tmp_path / "costs.json", tmp_path / "links.json"
    stage = {"fwd": 1e-3, "bwd": 2e-3, "act_bytes": 1e6}
    costs.write_text(json.dumps({"stages": [stage, stage]}))
    links.write_text(json.dumps({"devices": [{"name": "a"}, {"name": "b"}],
                                 "links": [{"src": "a", "dst": "b", "bandwidth": 1e9, "latency": 0.0}]}))
    command = ["simulate", "--costs", str(costs), "--topology", str(links), "--schedule", "gpipe", "--pp", "2",
               "--microbatches", "2", "--p2p", "buffered"]
    # gpipe, m 2, p 2: (m + p - 1)(F + B) = 9 ms, and one 1 ms transfer each way on the critical path
    (line,) = reproduction_lines(command, 11e-3)
    assert line.startswith(f"{REPRODUCE} (11.000 ms) again: pipesim simulate --costs")
    (line,) = reproduction_lines(command, 12e-3)
    assert line.startswith("note: pipesim simulate") and "predicts 11.000 ms, not compare's 12.000 ms" in line
    assert "give --schedule-out too" in line


@pytest.mark.parametrize(("flags", "message"), [
    (["--costs-out", "{tmp}"], "--costs-out {tmp} is a directory"),
    (["--topology-out", "{tmp}/missing/links.json"], "--topology-out {tmp}/missing/links.json: folder "
                                                     "{tmp}/missing does not exist"),
    (["--schedule-out", "{tmp}"], "--schedule-out {tmp} is a directory"),
    (["--costs-out", "{tmp}/a.json", "--topology-out", "{tmp}/a.json"],
     "--topology-out {tmp}/a.json: --costs-out writes that file too; give each its own path"),
    (["--topology", "ideal", "--topology-out", "{tmp}/links.json"],
     "--topology-out {tmp}/links.json: --topology ideal has free links and no file form"),
])
def test_bad_output_paths_are_one_line_with_status_2_before_anything_runs(tmp_path, capsys, flags, message):
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    assert main(["compare", *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(tmp=tmp_path) in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_calibrated_tp_all_reduce_survives_the_file_and_prices_every_tp_collective(tmp_path, capsys):
    # what compare sets after its calibration steps (held_collectives.tp_all_reduce): S / B + alpha
    bandwidth, latency, message = 8e8, 4e-3, 1024.0
    document = {"devices": [{"name": f"rank{rank}"} for rank in range(4)],
                "links": [{"src": f"rank{a}", "dst": f"rank{b}", "bandwidth": 1e9, "latency": 1e-4}
                          for a in range(4) for b in range(a + 1, 4)],
                "calibration": {"backend": "gloo"}}
    topology = topology_from_dict(document)
    topology.measured_collectives["all_reduce", 2] = (bandwidth, latency)
    save_topology(topology, tmp_path / "links.json")
    assert load_topology(str(tmp_path / "links.json")).measured_collectives == {("all_reduce", 2): (bandwidth,
                                                                                                   latency)}
    stage = {"fwd": 1e-3, "bwd": 2e-3, "layers": 1, "tp_message_bytes": message}
    (tmp_path / "costs.json").write_text(json.dumps({"stages": [stage, stage]}))
    assert main(["simulate", "--costs", str(tmp_path / "costs.json"), "--topology", str(tmp_path / "links.json"),
                 "--pp", "2", "--microbatches", "2", "--tp", "2", "--no-tp-overlap",
                 "--trace", str(tmp_path / "trace.json")]) == 0
    events = [event for event in json.loads((tmp_path / "trace.json").read_text())["events"]
              if event["stream"] == "tp"]
    assert len(events) == 2 * 2 * 2  # per rank: 2 microbatches x (F, B)
    for event in events:  # a layer's two all-reduces, each at the measured pace, not the links' ring
        assert event["end"] - event["start"] == pytest.approx(2 * (message / bandwidth + latency), rel=1e-9)


def test_calibrated_sequence_parallel_collectives_survive_the_file(tmp_path):
    # what compare sets with --sequence-parallel (held_collectives.tp_gather_scatter): one
    # pace for the all-gather and the reduce-scatter; a layer's F and B each hold two of
    # each (Megatron's 4 a pass), every one at S / B + alpha
    bandwidth, latency, message = 8e8, 2e-3, 2048.0
    document = {"devices": [{"name": f"rank{rank}"} for rank in range(4)],
                "links": [{"src": f"rank{a}", "dst": f"rank{b}", "bandwidth": 1e9, "latency": 1e-4}
                          for a in range(4) for b in range(a + 1, 4)],
                "calibration": {"backend": "gloo"}}
    topology = topology_from_dict(document)
    topology.measured_collectives.update({("all_gather", 2): (bandwidth, latency),
                                          ("reduce_scatter", 2): (bandwidth, latency)})
    save_topology(topology, tmp_path / "links.json")
    assert load_topology(str(tmp_path / "links.json")).measured_collectives == topology.measured_collectives
    stage = {"fwd": 1e-3, "bwd": 2e-3, "layers": 1, "tp_message_bytes": message}
    (tmp_path / "costs.json").write_text(json.dumps({"stages": [stage, stage]}))
    assert main(["simulate", "--costs", str(tmp_path / "costs.json"), "--topology", str(tmp_path / "links.json"),
                 "--pp", "2", "--microbatches", "2", "--tp", "2", "--sequence-parallel", "--no-tp-overlap",
                 "--trace", str(tmp_path / "trace.json")]) == 0
    events = [event for event in json.loads((tmp_path / "trace.json").read_text())["events"]
              if event["stream"] == "tp"]
    assert len(events) == 2 * 2 * 2
    for event in events:
        assert event["end"] - event["start"] == pytest.approx(4 * (message / bandwidth + latency), rel=1e-9)


def test_sequence_parallel_on_a_costs_file_that_says_otherwise_is_refused(tmp_path, capsys):
    # a file written by profile or compare says whether its run was sequence-parallel; the
    # flag must not be dropped without a word, nor contradict it
    stage = {"fwd": 1e-3, "bwd": 2e-3, "layers": 1, "tp_message_bytes": 2048.0}
    (tmp_path / "costs.json").write_text(json.dumps({"stages": [stage, stage], "sequence_parallel": False}))
    assert main(["simulate", "--costs", str(tmp_path / "costs.json"), "--pp", "2", "--microbatches", "2", "--tp", "2",
                 "--sequence-parallel"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--sequence-parallel" in error[0] and "measured without sequence parallelism" in error[0]


def test_presets_written_and_read_back_route_alike():
    for name in ("nvlink", "pcie", "ib"):
        topology = load_topology(name)
        read = topology_from_dict(json.loads(json.dumps(topology_to_dict(topology))), name="read")
        assert read.devices == topology.devices
        for a in topology.devices[:10]:
            assert read.device_memory(a) == topology.device_memory(a) and read.node_of(a) == topology.node_of(a)
            for b in topology.devices[:10]:
                if a != b:
                    assert read.route(a, b) == topology.route(a, b)


def test_an_ideal_topology_has_no_file_form():
    from pipesim.cluster.topology import TopologyError

    with pytest.raises(TopologyError, match="give --topology ideal instead"):
        topology_to_dict(load_topology("ideal"))


figures = st.floats(min_value=1e6, max_value=1e12, allow_nan=False)
latencies = st.floats(min_value=0.0, max_value=1e-2, allow_nan=False)


@st.composite
def topology_documents(draw) -> dict:
    """2-4 devices on a ring of links (some one-way, each way then given), a switch some
    hang off, measured collectives, a mapping that shuffles the devices."""
    count = draw(st.integers(2, 4))
    names = [f"g{index}" for index in range(count)]
    links = []
    for index in range(count):
        src, dst = names[index], names[(index + 1) % count]
        if src == dst or (count == 2 and index == 1):
            continue
        link = {"src": src, "dst": dst, "bandwidth": draw(figures), "latency": draw(latencies),
                "efficiency": draw(st.floats(0.1, 1.0))}
        if draw(st.booleans()):  # one way each, with figures of their own
            back = {"src": dst, "dst": src, "bandwidth": draw(figures), "latency": draw(latencies)}
            links += [{**link, "directed": True}, {**back, "directed": True}]
        else:
            links.append(link)
    document = {"devices": [{"name": name, "memory_bytes": draw(figures)} for name in names], "links": links,
                "mapping": draw(st.permutations(names))}
    if draw(st.booleans()):
        document["switches"] = [{"name": "sw", "kind": "pcie_switch"}]
        document["links"].append({"src": names[0], "dst": "sw", "bandwidth": draw(figures), "latency": 0.0})
    document["collectives"] = [{"operation": operation, "ranks": draw(st.integers(2, 8)), "bandwidth": draw(figures),
                                "latency": draw(latencies)}
                               for operation in draw(st.sets(st.sampled_from(FILE_COLLECTIVES)))]
    return document


@settings(max_examples=40, deadline=None)
@given(topology_documents())
def test_any_topology_file_written_back_reads_as_the_same_cluster(document):
    topology = topology_from_dict(document, name="given")
    read = topology_from_dict(json.loads(json.dumps(topology_to_dict(topology))), name="written")
    assert read.devices == topology.devices
    assert read.measured_collectives == topology.measured_collectives
    assert read.backend == topology.backend
    assert {(a, b): data for a, b, data in read.graph.edges(data=True)} == {
        (a, b): {**data, "medium": data.get("medium", "")} for a, b, data in topology.graph.edges(data=True)}
    for a in topology.devices:
        assert read.device_memory(a) == topology.device_memory(a)
        for b in topology.devices:
            if a != b:
                assert read.route(a, b) == topology.route(a, b)


LAYOUTS = {  # compare's layouts as RunConfig fields; the costs each needs priced
    "dp 2, small buckets": ({"dp": 2, "dp_bucket_mb": 0.01}, {"layers": 2, "param_bytes": 4e4}),
    "dp 2, ZeRO-1": ({"dp": 2, "zero": 1}, {"layers": 2, "param_bytes": 4e4}),
    "dp 2, ZeRO-2": ({"dp": 2, "zero": 2}, {"layers": 2, "param_bytes": 4e4}),
    "tp 2": ({"tp": 2}, {"layers": 2, "tp_message_bytes": 4096}),
    "tp 2, sequence parallel": ({"tp": 2, "sequence_parallel": True}, {"layers": 2, "tp_message_bytes": 4096}),
    "cp 2": ({"cp": 2, "model": "llama3-8b"}, {"layers": 2, "attention_layers": 2, "kv_bytes": 8192,
                                                "attention_fwd": 1e-4, "attention_bwd": 2e-4}),
    "dp 2, ep 2": ({"dp": 2, "ep": 2, "model": "mixtral-8x7b"}, {"layers": 2, "moe_layers": 2, "dispatch_bytes": 8192,
                                                                  "param_bytes": 4e4}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_printed_flags_rebuild_the_parallelism_compare_predicted_with(tmp_path, layout):
    """What compare's prediction is made of (its lowered programs, its costs, its links
    with measured collectives, ``replicas(config)``), written and read back by simulate's
    own parser and job: the same step, for every layout compare runs."""
    import argparse

    from executor.config import RunConfig, build_schedule
    from pipesim.cli.calibration_files import simulate_command, simulated_step, write_calibration_files
    from pipesim.cli.compare import replicas
    from pipesim.model.costs import costs_from_dict
    from pipesim.sim.step import run_simulation

    fields, priced = LAYOUTS[layout]
    config = RunConfig(schedule="1f1b", pp=2, microbatches=4, backend="gloo", **fields)
    shards = {axis: fields.get(axis, 1) for axis in ("dp", "tp", "cp", "ep")}
    stage = {"fwd": 1e-3, "bwd": 2e-3, "act_bytes": 1e5, **priced}
    costs = costs_from_dict({"stages": [stage, stage], "meta": {"source": "calibration steps of the run", **shards},
                             "sequence_parallel": config.sequence_parallel})  # as run_costs writes it
    ranks = config.world_size
    topology = topology_from_dict({"devices": [{"name": f"rank{rank}"} for rank in range(ranks)],
                                   "links": [{"src": f"rank{a}", "dst": f"rank{b}", "bandwidth": 1e9, "latency": 1e-4}
                                             for a in range(ranks) for b in range(a + 1, ranks)],
                                   "calibration": {"backend": "gloo"}})
    # as calibrate_held leaves them: the collectives timed on the run's own steps
    topology.measured_collectives.update({("all_reduce", 2): (5e8, 3e-4), ("all_to_all", 2): (4e8, 2e-4),
                                          ("ring_exchange", 2): (6e8, 1e-4)})
    schedule = build_schedule(config)
    predicted = run_simulation(schedule, costs, topology, p2p="buffered", parallel=replicas(config))
    args = argparse.Namespace(costs_out=str(tmp_path / "costs.json"), topology_out=str(tmp_path / "links.json"),
                              schedule_out=str(tmp_path / "programs.csv"))
    write_calibration_files(args, costs, topology, predicted.schedule)
    command = simulate_command(args, config, replicas(config), "buffered")
    assert simulated_step(command) == pytest.approx(predicted.metrics.makespan, rel=1e-9, abs=0)
    for flag, size in shards.items():
        if size > 1:
            assert command[command.index(f"--{flag}") + 1] == str(size)


def test_simulate_takes_cp_and_ep_without_a_model_only_from_costs_timed_on_those_shards(tmp_path, capsys):
    stage = {"fwd": 1e-3, "bwd": 2e-3, "layers": 1, "attention_layers": 1, "kv_bytes": 4096, "attention_fwd": 1e-4,
             "attention_bwd": 2e-4}
    for name, meta in (("cp2.json", {"cp": 2}), ("cp4.json", {"cp": 4}), ("none.json", {})):
        (tmp_path / name).write_text(json.dumps({"stages": [stage, stage], "meta": meta}))
    base = ["simulate", "--pp", "2", "--microbatches", "2", "--cp", "2", "--topology", "nvlink"]
    assert main([*base, "--costs", str(tmp_path / "cp2.json"), "--trace", str(tmp_path / "trace.json")]) == 0
    events = json.loads((tmp_path / "trace.json").read_text())["events"]
    assert any(event["stream"] == "cp" for event in events)  # the ring is charged
    capsys.readouterr()
    for name in ("cp4.json", "none.json"):
        assert main([*base, "--costs", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert "--cp 2 needs --model" in err and "compare --costs-out or profile --calibration run at --cp 2" in err


def test_a_command_simulate_refuses_is_a_note_not_a_failed_compare(tmp_path):
    from pipesim.cli.calibration_files import reproduction_lines

    stage = {"fwd": 1e-3, "bwd": 2e-3}
    (tmp_path / "costs.json").write_text(json.dumps({"stages": [stage, stage]}))  # no cp in its meta
    command = ["simulate", "--costs", str(tmp_path / "costs.json"), "--topology", "nvlink", "--pp", "2", "--cp", "2"]
    (line,) = reproduction_lines(command, 1e-3)
    assert line.startswith("note: pipesim simulate --costs")
    assert "cannot give this prediction back: --cp 2 needs --model" in line
