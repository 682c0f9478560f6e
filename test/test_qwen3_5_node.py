"""The vision node over real DDS with a tiny random Qwen 3.5 checkpoint (test_qwen3_5_fixtures):
periodic captions stamped with the frame's header, the on-demand service answering a query, and a
skill the family lacks refused with the reason."""
import json

import pytest

from test_qwen3_5_fixtures import SPECIALS, VOCAB, build
from ros_harness import RosGraph
from vision_family_node import caption_query_round_trip


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory):
    """The tiny checkpoint with every other ordinary token an end token, so the node's full-length
    requests (768 tokens allowed) end after a few tokens on random weights."""
    folder = tmp_path_factory.mktemp("qwen3_5_node") / "qwen3_5-quick"
    build(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(1, VOCAB - len(SPECIALS), 2))}))
    return folder


def test_vision_node_captions_and_answers_with_qwen3_5(graph, quick_dir):
    caption_query_round_trip(graph, quick_dir, "qwen3_5")
