"""Evaluation on a recorded bag: a bag of camera frames with drawn objects and espeak-ng speech as
AudioChunks at real capture stamps (sqlite3 with raw Images, mcap with JPEG CompressedImages) is
replayed at max rate through the whole graph (the small random Moondream checkpoint, real Whisper
tiny.en), with one damaged record among them, and the outputs hold together: one CSV row per
result message in the results bag, result headers naming the inputs that produced them, the
spoken words transcribed, every frame either with results or counted as dropped, the damaged
record skipped and counted, a readable report. Bad input fails with its reason; a bag with nothing
decodable is refused."""
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image as PILImage
from rclpy.serialization import serialize_message
from std_msgs.msg import Header

from moondream_fixtures import checkpoint
from photon_ros import evaluate
from photon_ros.bag_io import BagError, BagWriter, bag_topics, message_class, read_messages, stamp_ns
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.image_conversions import rgb_to_compressed, rgb_to_image
from photon_ros.msg import AudioChunk, Detections
from photon_ros.replay import replay_offsets
from photon_ros.result_log import flatten_message, write_csv
from photon_ros.result_messages import seconds_to_time
from photon_ros.wav_publisher import chunk_audio
from speech_audio import espeak_pcm, words

SENTENCE = "Find the red ball."
LEADING_S, TRAILING_S, CHUNK_S = 0.5, 1.0, 0.1
FRAMES = 3



def scene(i, size=(96, 128)):
    """A table-top frame: a red ball that moves to the right and a blue box."""
    frame = np.full((*size, 3), (200, 190, 170), np.uint8)
    cv2.rectangle(frame, (80, 50), (115, 85), (40, 60, 200), -1)
    cv2.circle(frame, (20 + 15 * i, 40), 12, (220, 30, 30), -1)
    return frame


def record_bag(path: Path, storage: str, compressed: bool) -> dict:
    """Speech with frames during it, stamped on one capture clock starting now; logged a few ms
    after capture, as a recorder would. Returns what was recorded."""
    t0 = time.time()
    pcm, rate = espeak_pcm(SENTENCE)
    chunks = chunk_audio(pcm, rate, CHUNK_S, LEADING_S, TRAILING_S)
    messages, sent = [], 0
    for chunk in chunks:
        header = Header(stamp=seconds_to_time(t0 + sent / rate), frame_id="microphone")
        messages.append(("/mic/audio", pcm_to_audio_chunk(chunk, rate, header=header), t0 + sent / rate))
        sent += len(chunk)
    frame_stamps = []
    for i in range(FRAMES):
        t = t0 + 0.2 + i * 0.5
        header = Header(stamp=seconds_to_time(t), frame_id="camera")
        msg = (rgb_to_compressed(scene(i), "jpeg", header=header) if compressed
               else rgb_to_image(scene(i), "bgr8", header=header))
        messages.append(("/camera/image_raw" + ("/compressed" if compressed else ""), msg, t))
        frame_stamps.append(stamp_ns(msg))
    with BagWriter(path, storage) as bag:
        for topic, msg, t in sorted(messages, key=lambda m: m[2]):
            bag.write(topic, msg, int((t + 0.003) * 1e9))
        # A damaged record among the chunks: skipped and counted, nothing else changes.
        bag.write_serialized("/mic/audio", "photon_ros/msg/AudioChunk", int((t0 + 0.25) * 1e9),
                             serialize_message(messages[0][1])[:40])
    return {"t0": t0, "frame_stamps": frame_stamps, "chunks": len(chunks)}


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("storage,compressed", [("sqlite3", False), ("mcap", True)])
def test_evaluate_a_recorded_bag_through_the_whole_graph(tmp_path, storage, compressed):
    bag = tmp_path / "session"
    recorded = record_bag(bag, storage, compressed)
    out = tmp_path / "eval"
    rc = evaluate.main([str(bag), "--graph", "all", "--rate", "max", "--out", str(out),
                        "--set", f"vision.model={checkpoint()}", "--set", "vision.detect=[red ball]",
                        "--set", "vision.point=[blue box]", "--set", "vision.max_objects=2"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["missing_results"] == []
    assert summary["undecodable_messages"] == {"/mic/audio": 1}

    # The results bag and the CSVs: one row per result message, topic by topic.
    results = {}
    for m in read_messages(out / "results", list(bag_topics(out / "results"))):
        results.setdefault(m.topic.lstrip("/"), []).append(m.msg)
    for topic in ("detections", "points", "caption", "transcript", "image_target", "target", "goal_pose", "cmd_vel", "status"):
        rows = read_csv(out / f"{topic}.csv")
        assert len(rows) == len(results.get(topic, [])) == summary["results"][topic], topic

    # Every frame gives results or is counted as not processed, by the vision node or on the way.
    vision = summary["vision"]
    frames = set(recorded["frame_stamps"])
    with_results = {stamp_ns(d) for d in results.get("detections", [])}
    assert vision["frames_published"] == FRAMES
    assert len(with_results) + vision["frames_dropped"] + vision["bad_frames"] \
        + vision["frames_lost_in_transport"] == FRAMES
    assert with_results, "no frame was processed"
    # Results carry the header of the frame that produced them, and the CSV names that frame.
    for topic in ("detections", "points"):
        assert {stamp_ns(m) for m in results[topic]} <= frames
        assert all(m.header.frame_id == "camera" for m in results[topic])
        for row in read_csv(out / f"{topic}.csv"):
            assert recorded["frame_stamps"][int(row["input_index"])] == int(row["stamp_ns"])
            assert float(row["delay_s"]) >= 0
    assert len(results["detections"]) == len(with_results)      # one prompt: one message per frame
    assert all(d.prompt == "red ball" for d in results["detections"])

    # The spoken sentence, stamped on the audio clock where it was said (its preroll included).
    finals = [t for t in results["transcript"] if t.is_final]
    assert len(finals) == 1 and words(finals[0].text) == words(SENTENCE)
    assert finals[0].audio_complete and finals[0].header.frame_id == "microphone"
    start = finals[0].header.stamp.sec + finals[0].header.stamp.nanosec * 1e-9
    assert recorded["t0"] <= start <= recorded["t0"] + LEADING_S + 0.3
    assert summary["speech"]["utterances_in_audio"] == 1
    assert summary["speech"]["discontinuities"] == 0 and summary["speech"]["chunks_published"] == recorded["chunks"]
    row = next(r for r in read_csv(out / "transcript.csv") if r["is_final"] == "True")
    assert words(row["text"]) == words(SENTENCE) and int(row["stamp_ns"]) == stamp_ns(finals[0])
    # The loop heard the command and asked the vision node about it.
    assert any("red ball" in s.data for s in results["status"])

    inputs = read_csv(out / "inputs.csv")
    assert len(inputs) == FRAMES + recorded["chunks"]
    with PILImage.open(out / "report.png") as png:
        png.verify()
    with PILImage.open(out / "report.png") as png:
        assert png.width >= 800 and png.height >= 800
        pixels = np.asarray(png.convert("L"))
    assert pixels.std() > 10, "the report is blank"


def test_bag_messages_keep_their_stamps_and_log_times(tmp_path):
    for storage in ("sqlite3", "mcap"):
        written = [("/audio", pcm_to_audio_chunk(np.zeros(160, np.float32), 16000,
                                                  header=Header(stamp=seconds_to_time(1e9 + i), frame_id="m")),
                    2_000_000_000 + i) for i in range(3)]
        with BagWriter(tmp_path / storage, storage) as bag:
            for topic, msg, t in written:
                bag.write(topic, msg, t)
        read = list(read_messages(tmp_path / storage, ["/audio"]))
        assert [(m.log_time_ns, m.msg.header, m.msgtype) for m in read] == \
            [(t, msg.header, "photon_ros/msg/AudioChunk") for _, msg, t in written]
        assert isinstance(read[0].msg, AudioChunk) and read[0].msg.data == written[0][1].data


def test_undecodable_messages_are_skipped_and_counted(tmp_path, capsys):
    def chunk(i):
        return pcm_to_audio_chunk(np.full(160, 0.1 * i, np.float32), 16000,
                                  header=Header(stamp=seconds_to_time(1e9 + i), frame_id="m"))
    audio = "photon_ros/msg/AudioChunk"
    for storage in ("sqlite3", "mcap"):
        bag_path = tmp_path / storage
        with BagWriter(bag_path, storage) as bag:
            bag.write("/audio", chunk(0), 1_000)
            bag.write_serialized("/audio", audio, 2_000, serialize_message(chunk(1))[:30])   # cut short
            bag.write("/audio", chunk(2), 3_000)
            bag.write_serialized("/audio", audio, 4_000, b"\x00\x01\x00\x00" + b"\xff" * 12)  # garbage
        skipped = []
        read = list(read_messages(bag_path, ["/audio"], skipped))
        assert [(m.log_time_ns, m.msg.data) for m in read] == [(1_000, chunk(0).data), (3_000, chunk(2).data)]
        assert [(s.topic, s.msgtype, s.log_time_ns) for s in skipped] == [("/audio", audio, 2_000),
                                                                          ("/audio", audio, 4_000)]
        assert all("failed to deserialize" in s.error for s in skipped)
        with pytest.raises(BagError, match="AudioChunk message on /audio logged at 2000 ns cannot be decoded"):
            list(read_messages(bag_path, ["/audio"]))
        inputs = evaluate.load_inputs(bag_path, "speech")
        assert len(inputs.messages["audio"]) == 2 and inputs.undecodable_counts() == {"/audio": 2}

    # Nothing readable: a clear error, before any node starts.
    only_bad = tmp_path / "only_bad"
    with BagWriter(only_bad) as bag:
        for t in (1, 2, 3):
            bag.write_serialized("/audio", audio, t, b"\x00\x01")
    assert evaluate.main([str(only_bad), "--graph", "speech"]) == 2
    err = capsys.readouterr().err
    assert "none of the 3 messages on /audio can be decoded (the first: failed to deserialize" in err


def test_a_bag_damaged_in_the_middle_is_named_unusable_input(tmp_path, capsys):
    """An mcap overwritten in its middle (a bad disk block, a copy cut short and patched) made
    rosbags raise OverflowError while reading on: a traceback and exit 1, where the evaluator
    promises exit 2 and the bag named for input it cannot use."""
    bag = tmp_path / "whole"
    with BagWriter(bag, "mcap") as w:
        for i in range(40):
            w.write("/mic/audio", pcm_to_audio_chunk(np.full(1600, 0.01 * (i % 7), np.float32), 16000,
                                                     header=Header(stamp=seconds_to_time(1000.0 + i / 10))),
                    1_000_000 + i)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in bag.iterdir():
        data = bytearray(f.read_bytes())
        if f.suffix == ".mcap":
            at = len(data) // 2
            data[at:at + 4096] = b"\xff" * len(data[at:at + 4096])
        (damaged / f.name).write_bytes(bytes(data))
    with pytest.raises(BagError, match=r"damaged after \d+ messages"):
        list(read_messages(damaged, ["/mic/audio"]))
    assert evaluate.main([str(damaged), "--graph", "speech", "--out", str(tmp_path / "out")]) == 2
    assert "damaged after" in capsys.readouterr().err
    # damaged in its header: refused as it opens (OverflowError from the storage, a traceback)
    mcap = next(damaged.glob("*.mcap"))
    data = bytearray(next(bag.glob("*.mcap")).read_bytes())
    data[16:24] = b"\xff" * 8
    mcap.write_bytes(bytes(data))
    with pytest.raises(BagError, match="damaged, cannot be read"):
        list(read_messages(damaged, ["/mic/audio"]))


def test_a_topic_recorded_with_two_types_is_refused_before_the_replay(tmp_path):
    """A topic recorded with two types was taken as the type bag_topics named, and the other's
    messages reached its publisher mid-replay: a TypeError in the replay's thread, a traceback.
    Now it is unusable input, named with its types, before any node starts."""
    header = Header(stamp=seconds_to_time(1000.0), frame_id="camera")
    for storage in ("sqlite3", "mcap"):
        bag = tmp_path / storage
        with BagWriter(bag, storage) as w:
            w.write("/camera/image_raw", rgb_to_compressed(scene(0), "jpeg", header=header), 1_000)
            w.write("/camera/image_raw", rgb_to_image(scene(1), "rgb8", header=header), 2_000)
            w.write("/mic/audio", pcm_to_audio_chunk(np.zeros(160, np.float32), 16000, header=header), 3_000)
        mixed = r"topic /camera/image_raw was recorded with several message types \(" \
                r"sensor_msgs/msg/CompressedImage, sensor_msgs/msg/Image\)"
        with pytest.raises(BagError, match=mixed):
            evaluate.load_inputs(bag, "vision")
        with pytest.raises(BagError, match=mixed):
            list(read_messages(bag, ["/camera/image_raw", "/mic/audio"]))
        # a graph that does not replay it is not refused for it
        assert len(evaluate.load_inputs(bag, "speech").messages["audio"]) == 1


def test_replay_keeps_the_bag_spacing_scaled_by_the_rate():
    times = [5_000_000_000, 5_500_000_000, 7_000_000_000]
    assert replay_offsets(times, 5_000_000_000, 1.0) == [0.0, 0.5, 2.0]
    assert replay_offsets(times, 4_000_000_000, 2.0) == [0.5, 0.75, 1.5]
    assert replay_offsets(times, 5_000_000_000, None) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        replay_offsets(times, 0, 0.0)


def test_csv_has_one_row_per_message_with_flat_fields(tmp_path):
    msgs = [Detections(header=Header(stamp=seconds_to_time(10.5), frame_id="cam"), prompt=p) for p in "ab"]
    rows = [flatten_message(m) for m in msgs]
    assert rows[0]["header.stamp"] == 10.5 and rows[0]["header.frame_id"] == "cam"
    assert rows[1]["prompt"] == "b" and json.loads(rows[1]["detections"]) == []
    write_csv(tmp_path / "d.csv", rows)
    assert [r["prompt"] for r in read_csv(tmp_path / "d.csv")] == ["a", "b"]


def fake_type_bag(path: Path) -> None:
    """A bag with one topic of a type no package here defines."""
    from rosbags.rosbag2 import Writer

    with Writer(path, version=Writer.VERSION_LATEST) as writer:
        conn = writer.add_connection("/thing", "fake_msgs/msg/Thing", msgdef="int32 x",
                                     rihs01="RIHS01_" + "0" * 64)
        writer.write(conn, 1, b"\x00\x01\x00\x00\x05\x00\x00\x00")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "photon_ros.evaluate", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_bad_input_fails_with_its_reason(tmp_path, capsys):
    out = run_cli(tmp_path / "nope", "--graph", "vision")
    assert out.returncode == 2 and "no such bag" in out.stderr

    unknown = tmp_path / "odd"
    unknown.mkdir()
    (unknown / "metadata.yaml").write_text(
        "rosbag2_bagfile_information:\n  version: 9\n  storage_identifier: rosbag_v1\n"
        "  relative_file_paths: [odd.bag]\n")
    (unknown / "odd.bag").write_bytes(b"#ROSBAG V2.0\n")
    assert evaluate.main([str(unknown), "--graph", "vision"]) == 2
    assert "rosbag_v1" in capsys.readouterr().err

    plain = tmp_path / "frame.png"
    plain.write_bytes(b"not a bag")
    assert evaluate.main([str(plain)]) == 2
    assert "cannot read it as a rosbag2 bag" in capsys.readouterr().err

    fake = tmp_path / "fake"
    fake_type_bag(fake)
    assert evaluate.main([str(fake), "--graph", "vision"]) == 2
    err = capsys.readouterr().err
    assert "no image topic" in err and "/thing (fake_msgs/msg/Thing)" in err
    assert evaluate.main([str(fake), "--graph", "vision", "--image-topic", "/thing"]) == 2
    err = capsys.readouterr().err
    assert "/thing is fake_msgs/msg/Thing" in err and "cannot take as image" in err
    with pytest.raises(BagError, match="not installed"):
        list(read_messages(fake, ["/thing"]))
    with pytest.raises(BagError, match="not installed"):
        message_class("fake_msgs/msg/Thing")

    with pytest.raises(SystemExit):
        evaluate.main([str(fake), "--rate", "0"])
    assert evaluate.main([str(fake), "--set", "detect=[cup]"]) == 2
    assert "NODE.PARAM=VALUE" in capsys.readouterr().err
    assert evaluate.main([str(fake), "--set", "visoin.detect=[cup]"]) == 2
    assert "names no node" in capsys.readouterr().err
    # checked before anything runs: a traceback, a bad argument read as a model's failure (exit 3),
    # results lost after the whole replay
    assert evaluate.main([str(fake), "--config", str(tmp_path / "none.yaml")]) == 2
    assert "--config" in capsys.readouterr().err
    for settle in ("-5", "nan", "inf", "0"):
        assert evaluate.main([str(fake), "--settle-timeout", settle]) == 2
        assert "--settle-timeout" in capsys.readouterr().err
    assert evaluate.main([str(fake), "--out", str(plain)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_an_infinite_rate_is_a_bad_argument(tmp_path, capsys):
    """--rate inf was taken: the speech node's idle flush, 0.8 s / inf = 0, was refused only once
    the models had loaded (exit 1, "graph cannot run"). Now it is a bad argument, named (exit 2)."""
    for rate in ("inf", "1e999", "-inf", "nan"):
        with pytest.raises(SystemExit) as refused:
            evaluate.main([str(tmp_path / "no_bag"), "--graph", "speech", "--rate", rate])
        assert refused.value.code == 2 and "argument --rate" in capsys.readouterr().err


def test_only_the_streams_a_graph_takes_are_chosen(tmp_path):
    """A RealSense bag has colour and depth images: a speech graph need not choose between them
    (it failed with 'several image topics'); a vision graph takes the one not named for depth, and
    asks for --image-topic where several colour images remain."""
    bag = tmp_path / "realsense"
    header = Header(stamp=seconds_to_time(1000.0), frame_id="camera")
    frame = rgb_to_image(np.zeros((8, 8, 3), np.uint8), "bgr8", header=header)
    chunk = pcm_to_audio_chunk(np.zeros(1600, np.float32), 16000, "S16LE", header=header)
    with BagWriter(bag, "sqlite3") as w:
        for topic, msg in (("/camera/color/image_raw", frame), ("/camera/depth/image_rect_raw", frame),
                           ("/mic/audio", chunk)):
            w.write(topic, msg, int(1000.1e9))
    inputs = evaluate.load_inputs(bag, "speech")
    assert inputs.topics == {"audio": "/mic/audio"}
    assert evaluate.load_inputs(bag, "vision").topics == {"image": "/camera/color/image_raw"}
    assert evaluate.load_inputs(bag, "vision", image_topic="/camera/depth/image_rect_raw").topics == \
        {"image": "/camera/depth/image_rect_raw"}   # named: taken
    with BagWriter(tmp_path / "two", "sqlite3") as w:
        for topic in ("/left/image_raw", "/right/image_raw"):
            w.write(topic, frame, int(1000.1e9))
    with pytest.raises(BagError, match="several image topics"):
        evaluate.load_inputs(tmp_path / "two", "vision")


def test_unstamped_audio_at_max_rate_is_paced_by_what_the_node_takes(tmp_path):
    """Int16MultiArray audio carries no stamps: at max rate each chunk waited for DDS to acknowledge
    it, which a best-effort reader never does, so the whole bag went at once into a queue of 100 and
    every command before the last ~100 chunks was lost, unseen. Now each waits until the node has
    taken the chunks 50 before it: three commands in 160 chunks, three transcripts."""
    from scipy.signal import resample_poly
    from photon_ros.audio_conversions import pcm_to_int16_array
    parts = []
    for sentence in ("Find the red ball.", "Point at the blue box.", "Hello robot, how are you today?"):
        pcm, sr = espeak_pcm(sentence)
        parts += [pcm, np.zeros(int(1.5 * sr), np.float32)]
    audio = resample_poly(np.concatenate(parts), 16000, sr).astype(np.float32)
    bag, t0, sent = tmp_path / "int16", time.time() - 3600, 0   # recorded an hour ago
    with BagWriter(bag, "mcap") as w:
        for c in chunk_audio(audio, 16000, 0.05, 0.5, 1.0):
            w.write("/audio_raw", pcm_to_int16_array(c), int((t0 + sent / 16000) * 1e9))
            sent += len(c)
    out = tmp_path / "eval"
    assert evaluate.main([str(bag), "--graph", "speech", "--rate", "max", "--out", str(out)]) == 0
    finals = [r for r in read_csv(out / "transcript.csv") if r["is_final"] == "True"]
    assert len(finals) == 3 and words(finals[0]["text"]) == words("Find the red ball.")
    # Unstamped, each transcript is still tied to the chunk that ended its utterance (by when it was
    # published: the node stamps such audio as it arrives), so it has a delay.
    indices = [int(r["input_index"]) for r in finals]
    assert indices == sorted(indices) and all(float(r["delay_s"]) > 0 for r in finals)
    # ... and placed on the recording's timeline, not an hour after it (the node's clock)
    times = [float(r["time_s"]) for r in finals]
    assert 0 <= times[0] < times[1] < times[2] < sent / 16000, times


def test_results_of_frames_sharing_a_stamp_name_no_frame():
    """A camera that leaves its stamps 0 (or repeats them): every result was credited to the last
    frame with that stamp, with negative delays. Now they name none, and 0 is no time on the timeline."""
    from photon_ros.replay import Published
    from photon_ros.result_log import InputTimeline, Output
    published = [Published("image", i, 0, 10 + i, at=float(i)) for i in range(3)]
    published += [Published("image", 3, 5_000_000_000, 13, at=3.0)]
    timeline = InputTimeline.build(published, {})
    assert timeline.shared == {0}
    frame = Output("detections", Detections, "frame")
    unstamped, stamped = Detections(), Detections()
    stamped.header.stamp.sec = 5
    assert timeline.source(frame, unstamped) is None and timeline.seconds(0) is None
    assert timeline.source(frame, stamped).index == 3


def test_the_report_places_and_judges_frames_as_inputs_csv_does(tmp_path, monkeypatch):
    """The report's frames panel put frames stamped 0 at no time (an empty panel under a legend
    counting them) and drew every frame of a shared stamp "with results" when one result carried
    it, where inputs.csv placed them at their log times and left has_results empty. Now both
    follow one rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from types import SimpleNamespace
    from photon_ros.eval_graph import Run
    from photon_ros.eval_report import frames_panel
    from photon_ros.replay import Published
    from photon_ros.result_log import Output, Result
    published = [Published("image", i, 0, 1_000_000_000 + i * 100_000_000, at=float(i)) for i in range(3)]
    published += [Published("image", 3, 2_000_000_000, 2_000_000_000, at=3.0),
                  Published("image", 4, 3_000_000_000, 3_000_000_000, at=4.0)]
    unstamped, stamped = Detections(), Detections()
    stamped.header.stamp.sec = 2
    results = [Result("detections", msg, 1, 5.0) for msg in (unstamped, stamped)]
    log = SimpleNamespace(outputs=[Output("detections", Detections, "frame")],
                          results=lambda topic=None: [r for r in results if topic in (None, r.topic)])
    drawn = []
    monkeypatch.setattr(evaluate, "plot_report", lambda path, data: drawn.append(data))
    evaluate.write_outputs(tmp_path, "mcap", evaluate.Inputs(tmp_path / "bag", {"image": "/camera/image_raw"}),
                           Run(published, log, {}, {}, []), "report")
    rows = read_csv(tmp_path / "inputs.csv")
    report = drawn[0]
    assert report.frame_times == [float(r["time_s"]) for r in rows] == pytest.approx([0.0, 0.1, 0.2, 1.0, 2.0])
    assert report.frame_has_result == [None, None, None, True, False]
    assert [r["has_results"] for r in rows] == ["", "", "", "True", "False"]
    fig, ax = plt.subplots()
    frames_panel(ax, report.frame_times, report.frame_has_result, "")
    assert ax.get_legend_handles_labels()[1] == ["with results (1)", "without results (1)",
                                                 "stamp shared by several frames: not known (3)"]
    plt.close(fig)


def test_transcripts_of_unstamped_audio_are_tied_to_the_utterances_the_node_cut():
    """Audio without stamps (std_msgs arrays, AudioChunks stamped 0) is stamped by the speech node
    on its clock as it arrives: zero-stamped chunks' transcripts named no chunk, and at max rate
    every transcript was tied to the bag's last chunk (the node's arrivals bunch behind the
    replay), its delay from there and its place an hour from the frames'. Now each utterance's
    transcripts are tied to the utterance the same segmenter cuts from the same samples: its
    final's duration finds it, past utterances that gave no transcript, across a rate change, and
    beside stamped audio in the same stream."""
    from photon_ros.graph_probe import Predicted
    from photon_ros.msg import Transcript
    from photon_ros.replay import Published
    from photon_ros.result_log import InputTimeline, Output
    recorded, node_clock = 1_000_000_000_000, 5_000_000_000_000
    # 0.1 s chunks logged as their capture ends, all arriving at once at the node: ten at 16 kHz,
    # then ten at 48 kHz, then ten stamped
    published = [Published("audio", i, 0, recorded + (i + 1) * 100_000_000, at=float(i), wall_ns=node_clock)
                 for i in range(20)]
    published += [Published("audio", i, recorded + i * 100_000_000, recorded + (i + 1) * 100_000_000,
                            at=float(i), wall_ns=node_clock) for i in range(20, 30)]
    published.append(Published("image", 0, recorded + 50_000_000, recorded + 53_000_000, at=2.5))
    samples = {i: (1600 * i, 1600, 16000) for i in range(10)}
    samples |= {i: (16000 + 4800 * (i - 10), 4800, 48000) for i in range(10, 30)}
    ends = {i: None for i in range(20)} | {i: (recorded + (i + 1) * 100_000_000) / 1e9 for i in range(20, 30)}
    utterances = [Predicted(None, 1600, 4000, 16000), Predicted(None, 4000, 8800, 16000),   # 0.1-0.25, 0.25-0.55 s
                  Predicted(None, 8800, 9600, 16000),                                       # 0.55-0.6 s: nothing heard
                  Predicted(None, 16000 + 4800, 16000 + 19200, 48000),                       # 1.1-1.4 s
                  Predicted((recorded + 2_200_000_000) / 1e9, 0, 9600, 48000)]               # 2.2-2.4 s, stamped
    timeline = InputTimeline.build(published, ends, samples, utterances)

    def transcript(stamp_ns, duration_s, final=True):
        t = Transcript(is_final=final)
        t.header.stamp.sec, t.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
        t.audio_duration.sec, t.audio_duration.nanosec = divmod(round(duration_s * 1e9), 1_000_000_000)
        return t
    heard = [transcript(7 * 10**9, 0.1, final=False), transcript(7 * 10**9, 0.15),   # the first: a partial, its final
             transcript(9 * 10**9, 0.3),          # the second (whatever the node's clock said)
             transcript(10 * 10**9, 0.3),         # the fourth, at 48 kHz: the third gave no transcript
             transcript(recorded + 2_200_000_000, 0.2)]   # the fifth, stamped
    timeline.match_utterances(heard)
    utterance = Output("transcript", Transcript, "utterance")
    assert timeline.t0_ns == recorded + 50_000_000 and timeline.input_seconds(published[-1]) == 0.0
    assert [timeline.source(utterance, t).index for t in heard] == [1, 2, 5, 13, 23]   # chunks of their last samples
    assert [timeline.result_seconds(utterance, t) for t in heard] == pytest.approx([0.05, 0.05, 0.2, 1.05, 2.15])
    assert timeline.result_seconds(utterance, transcript(11 * 10**9, 0.7)) is None   # none was predicted so long


def test_cmd_vel_is_recorded_as_the_loop_publishes_it():
    """With stamped_cmd_vel the loop publishes TwistStamped: a Twist recorder never matched it and
    recorded no motion at all."""
    from types import SimpleNamespace
    from geometry_msgs.msg import Twist, TwistStamped
    from photon_ros.result_log import role_outputs

    def cmd_vel(node):
        return next(o.msg_class for o in role_outputs("loop", node) if o.topic == "cmd_vel")
    assert cmd_vel(None) is Twist and cmd_vel(SimpleNamespace(stamped=False)) is Twist
    assert cmd_vel(SimpleNamespace(stamped=True)) is TwistStamped


def test_segmentation_results_are_recorded_and_awaited():
    """A segment prompt's outlines were neither recorded nor awaited: a segment-only evaluation
    recorded nothing and ran until the settle timeout."""
    from types import SimpleNamespace
    from photon_ros.graph_probe import VisionProbe
    from photon_ros.result_log import role_outputs
    assert ("segmentation", "frame") in [(o.topic, o.source) for o in role_outputs("vision")]
    node = SimpleNamespace(detect_targets=["cup"], point_targets=[], segment_targets=["mug"])
    assert VisionProbe(node).prompts() == [("detections", "cup"), ("segmentation", "mug")]


def test_a_stalled_replay_keeps_what_was_published():
    """A gate that gives up on the graph (it stopped taking input) stopped the evaluation with
    nothing written; the replay now hands back what it published, and the run writes it out."""
    from types import SimpleNamespace
    from photon_ros.graph_probe import GraphError
    from photon_ros.replay import Gate, ReplayStalled, Stream, replay

    class GivesUp(Gate):
        def wait_turn(self, index, stop):
            if index == 2:
                raise GraphError("the vision node answered no frame for 0.1 s")

    sent = []
    messages = [SimpleNamespace(msg=Detections(), log_time_ns=i) for i in range(4)]
    stream = Stream("image", "image", messages, SimpleNamespace(publish=sent.append), GivesUp())
    with pytest.raises(ReplayStalled, match="answered no frame") as stalled:
        replay([stream], None)
    assert [p.index for p in stalled.value.published] == [0, 1] and len(sent) == 2


def test_at_max_rate_the_streams_go_out_in_the_bags_order():
    """Each stream paced only by its own gate drifted from the other (the audio of a command far
    ahead of the frames its find was answered on); now a message waits for the other streams'
    earlier ones, whatever each gate's pace."""
    from types import SimpleNamespace
    from photon_ros.replay import Gate, Stream, replay

    class Slow(Gate):
        def wait_turn(self, index, stop):
            time.sleep(0.02)

    sent = []
    image = [SimpleNamespace(msg=Detections(), log_time_ns=t) for t in (0, 10, 20, 30)]
    audio = [SimpleNamespace(msg=AudioChunk(), log_time_ns=t) for t in (5, 15, 25, 35)]
    published = replay([Stream("image", "image", image, SimpleNamespace(publish=sent.append), Slow()),
                        Stream("audio", "audio", audio, SimpleNamespace(publish=sent.append))], None)
    assert [p.log_time_ns for p in published] == [0, 5, 10, 15, 20, 25, 30, 35]


def test_sim_time_is_refused_with_the_reason(tmp_path, capsys):
    """The replay publishes no /clock: with use_sim_time the nodes stamped transcripts near 0 and
    the loop's timer never fired, and the run said rc 0. Refused now, saying why."""
    bag = tmp_path / "session"
    record_bag(bag, "sqlite3", False)
    assert evaluate.main([str(bag), "--graph", "speech", "--set", "speech.use_sim_time=true",
                          "--out", str(tmp_path / "eval")]) == 1
    assert "use_sim_time is not supported" in capsys.readouterr().err


def test_a_bags_frames_are_read_as_replayed_not_held(tmp_path):
    """Every frame was held in memory before the replay (0.9 MB a 640x480 frame: 16 GB for ten
    minutes of a robot's camera). Now only their log times and stamps are, and each is read when
    it is replayed: the same messages, in order."""
    import tracemalloc
    bag = tmp_path / "frames"
    with BagWriter(bag, "mcap") as w:
        for i in range(40):
            header = Header(stamp=seconds_to_time(1000.0 + i / 30), frame_id="camera")
            frame = np.full((480, 640, 3), i, np.uint8)
            w.write("/camera/image_raw", rgb_to_image(frame, "bgr8", header=header), int((1000.0 + i / 30) * 1e9))
    tracemalloc.start()
    inputs = evaluate.load_inputs(bag, "vision")
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert held < 5e6, held                                 # 40 frames: 37 MB
    frames = inputs.messages["image"]
    assert len(frames) == 40
    for i, m in enumerate(frames):
        assert stamp_ns(m.msg) == frames.stamp_of(i) and bytes(m.msg.data[:1]) == bytes([i])
    assert frames[3].msg.data[0] == 3                       # going back reads the bag again


def test_a_caption_only_graph_ends_once_its_frames_are_done(tmp_path):
    """With no prompt every frame answers (captions only), the results could not be told apart by
    frame and only the settle timeout ended the evaluation: every run waited it out (120 s) and
    exited 3 with all its results in. Now it ends once the vision worker is done with every frame."""
    bag, t0 = tmp_path / "captions", time.time()
    with BagWriter(bag, "mcap") as w:
        for i in range(FRAMES):
            header = Header(stamp=seconds_to_time(t0 + 0.5 * i), frame_id="camera")
            w.write("/image_raw", rgb_to_image(scene(i), "rgb8", header=header), int((t0 + 0.5 * i + 0.003) * 1e9))
    out = tmp_path / "eval"
    rc = evaluate.main([str(bag), "--graph", "vision", "--rate", "max", "--out", str(out), "--settle-timeout", "120",
                        "--set", f"vision.model={checkpoint()}", "--set", "vision.detect=[]", "--set", "vision.point=[]",
                        "--set", "vision.caption_period_s=0.001"])
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0 and summary["missing_results"] == []
    assert summary["results"]["caption"] == summary["vision"]["frames_processed"] >= 1


def test_speech_is_cut_as_live_when_the_replay_is_not_at_the_bags_pace(tmp_path, monkeypatch):
    """The speech node ends an utterance after idle_flush_s (0.8 s) without audio, by the wall
    clock. At max rate the audio waits wherever the frames before it in the bag wait for the vision
    model (a real Moondream 2 frame takes seconds on a CPU): the command came out as fragments,
    incomplete, the loop did not act, and the run exited 0. At a rate below 1 the bag's gaps grow
    alike. Now the idle flush follows the replay's pace (off at max rate, the recording's end
    ending the last utterance), and the command is heard whole."""
    import photon_ros.vision_node as vision_node
    from photon_ros.graph_probe import NO_IDLE_FLUSH_S, SpeechProbe

    prepare = vision_node.prepared_image

    def slow_prepare(engine, rgb):   # a frame as slow as a real model's: longer than idle_flush_s
        time.sleep(1.2)
        return prepare(engine, rgb)
    monkeypatch.setattr(vision_node, "prepared_image", slow_prepare)
    bag = tmp_path / "session"
    record_bag(bag, "sqlite3", False)
    out = tmp_path / "eval"
    rc = evaluate.main([str(bag), "--graph", "all", "--rate", "max", "--out", str(out),
                        "--set", f"vision.model={checkpoint()}", "--set", "vision.detect=[red ball]",
                        "--set", "vision.max_objects=1"])
    finals = [r for r in read_csv(out / "transcript.csv") if r["is_final"] == "True"]
    assert rc == 0 and len(finals) == 1, [r["text"] for r in finals]
    assert words(finals[0]["text"]) == words(SENTENCE) and finals[0]["audio_complete"] == "True"
    assert any("looking for 'red ball'" in r["data"] for r in read_csv(out / "status.csv"))

    # at a rate: the node's idle_flush_s scaled by it, set before the replay and applied
    from types import SimpleNamespace
    set_to = []
    node = SimpleNamespace(params={"idle_flush_s": 0.8}, set_parameters=lambda ps: (
        set_to.extend(p.value for p in ps), [SimpleNamespace(successful=True)])[1])
    SpeechProbe(node).pace(0.25)
    SpeechProbe(node).pace(None)
    assert set_to == [pytest.approx(3.2), NO_IDLE_FLUSH_S]


def depth_bag(path: Path, with_depth: bool = True) -> list[int]:
    """A RealSense-like recording: colour frames, the depth aligned to them (a wall 2 m away) and
    the raw depth beside it, and each camera's info; returns the frames' stamps."""
    from sensor_msgs.msg import CameraInfo, Image

    def info(header):
        return CameraInfo(header=header, width=128, height=96, distortion_model="plumb_bob", d=[0.0] * 5,
                          k=[100.0, 0.0, 64.0, 0.0, 100.0, 48.0, 0.0, 0.0, 1.0],
                          r=[1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0], p=[100.0, 0.0, 64.0, 0.0, 0.0, 100.0, 48.0, 0.0, 0.0, 0.0, 1.0, 0.0])

    def wall(header, metres):
        return Image(header=header, height=96, width=128, encoding="16UC1", step=256,
                     data=np.full((96, 128), metres * 1000, "<u2").tobytes())
    t0, stamps = time.time(), []
    with BagWriter(path, "mcap") as w:
        for i in range(FRAMES):
            t = t0 + 0.5 * i
            colour = Header(stamp=seconds_to_time(t), frame_id="camera_color_optical_frame")
            log = int((t + 0.003) * 1e9)
            frame = rgb_to_image(scene(i), "rgb8", header=colour)
            w.write("/camera/color/image_raw", frame, log)
            w.write("/camera/color/camera_info", info(colour), log)
            stamps.append(stamp_ns(frame))
            if with_depth:
                w.write("/camera/aligned_depth_to_color/image_raw", wall(colour, 2.0), log + 1000)
                raw = Header(stamp=colour.stamp, frame_id="camera_depth_optical_frame")
                w.write("/camera/depth/image_rect_raw", wall(raw, 3.0), log + 2000)
                w.write("/camera/depth/camera_info", info(raw), log + 2000)
    return stamps


def test_a_bag_with_depth_is_evaluated_in_metres(tmp_path, capsys):
    """With vision.use_depth the bag's aligned depth and the colour camera's info are replayed (they
    were ignored: no position came and the run passed, with only a log line to say why) and the
    3D results recorded."""
    bag = tmp_path / "realsense"
    stamps = depth_bag(bag)
    out = tmp_path / "eval"
    rc = evaluate.main([str(bag), "--graph", "vision", "--rate", "max", "--out", str(out),
                        "--set", f"vision.model={checkpoint()}", "--set", "vision.detect=[red ball]",
                        "--set", "vision.max_objects=1", "--set", "vision.use_depth=true"])
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0, capsys.readouterr().err
    assert summary["inputs"] == {"image": "/camera/color/image_raw", "depth": "/camera/aligned_depth_to_color/image_raw",
                                 "camera_info": "/camera/color/camera_info"}
    assert set(summary["ignored_topics"]) == {"/camera/depth/image_rect_raw", "/camera/depth/camera_info"}
    placed = read_csv(out / "objects_3d.csv")
    assert placed and {int(r["stamp_ns"]) for r in placed} <= set(stamps)
    objects = [o for r in placed for o in json.loads(r["objects"])]
    assert objects and all(o["has_position"] and abs(o["pose.position.z"] - 2.0) < 0.05 for o in objects)
    assert all(r["header.frame_id"] == "camera_color_optical_frame" for r in placed)

    # what the replay cannot give the node is said before it runs
    assert evaluate.main([str(bag), "--graph", "vision", "--set", "vision.use_depth=true",
                          "--set", "vision.target_frame=base_link", "--out", str(tmp_path / "e2")]) == 2
    assert "/tf" in capsys.readouterr().err
    assert evaluate.main([str(bag), "--graph", "vision", "--depth-topic", "/camera/depth/image_rect_raw",
                          "--out", str(tmp_path / "e3")]) == 2
    assert "use_depth" in capsys.readouterr().err
    flat = tmp_path / "colour_only"
    depth_bag(flat, with_depth=False)
    assert evaluate.main([str(flat), "--graph", "vision", "--set", "vision.use_depth=true",
                          "--out", str(tmp_path / "e4")]) == 2
    assert "no depth image" in capsys.readouterr().err


def test_a_refused_chunk_cuts_the_predicted_utterance_as_the_node_cuts_it():
    """The speech node ends the utterance around a chunk it refuses (a NaN sample) and speech after
    it is another; the evaluator left the chunk out, predicted one utterance where unstamped audio
    (std_msgs arrays) made two, waited for one final and lost the second, exiting 0."""
    from photon_ros.audio_conversions import Pcm
    from photon_ros.graph_probe import predict_utterances
    from photon_ros.speech_segmenter import SegmenterConfig
    from speech_audio import espeak_pcm

    speech, rate = espeak_pcm("the quick brown fox jumps over the lazy dog")
    samples = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    chunks = [Pcm(samples[i:i + 1600], rate) for i in range(0, len(samples), 1600)]
    middle = (rate // 2 + len(speech) // 2) // 1600
    whole = predict_utterances([(c, None) for c in chunks], SegmenterConfig())
    assert len(whole) == 1
    refused = [(None if i == middle else c, None) for i, c in enumerate(chunks)]
    cut = predict_utterances(refused, SegmenterConfig())
    assert len(cut) == 2 and cut[0].end <= middle * 1600 <= cut[1].first, cut


def test_the_prediction_refuses_the_chunks_the_node_refuses():
    """A chunk at a rate the speech node refuses (outside MIN_RATE..MAX_RATE) is a hole where the
    node cuts the utterance: the prediction decoded it as audio and counted one utterance too few."""
    from types import SimpleNamespace

    from photon_ros.graph_probe import SpeechProbe
    probe = SpeechProbe(SimpleNamespace(params={}))
    good = pcm_to_audio_chunk(np.zeros(160, np.float32), 16000)
    assert probe.decode(good).sample_rate == 16000
    with pytest.raises(ValueError, match=r"sample rate 2000 Hz is outside 4000\.\.384000 Hz"):
        probe.decode(pcm_to_audio_chunk(np.zeros(160, np.float32), 2000))
