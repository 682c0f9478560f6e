"""The vision node over real DDS with the tiny random Gemma 4 checkpoint (test_gemma4_fixtures):
periodic captions published with the frame's header, and the on-demand service answering a query
and refusing a task the family does not have."""
import json
import shutil

import pytest

from test_gemma4_fixtures import EOS, EOT, SPECIALS, VOCAB, gemma4_dir, gemma4_hf  # noqa: F401
from ros_harness import RosGraph
from vision_family_node import caption_query_round_trip


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


@pytest.fixture(scope="module")
def quick_dir(gemma4_dir, tmp_path_factory):
    """The same checkpoint with every other token an end token, so the node's full-length
    requests (768 tokens allowed) end after a few tokens on these random weights."""
    folder = tmp_path_factory.mktemp("gemma4_quick") / "gemma4-quick"
    shutil.copytree(gemma4_dir, folder)
    eos = [EOS, EOT] + list(range(len(SPECIALS), VOCAB, 2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def test_vision_node_captions_and_answers_with_gemma4(graph, quick_dir):
    caption_query_round_trip(graph, quick_dir, "gemma4")
