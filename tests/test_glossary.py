"""One meaning a word (docs/architecture.md, "Glossary"): the names retired because each meant
two things stay out of hyparflow's code. Only identifiers count: prose may still quote them."""

import io
import tokenize

from tests.support.sources import python_sources

# retired name -> what the code says instead
RETIRED = {
    "SplitLayers": "ShardedLayers",
    "ChunkedLayout": "BucketedLayout",
    "CHUNK_BYTES": "BUCKET_BYTES",
    "ZeroLayout": "SliceLayout",
    "ZeroCheckpoint": "SliceCheckpoint",
    "ZeroGradients": "SliceGradients",
    "segment_parts": "segment_positions",
    "take_router_parts": "take_router_losses",
    "zero": "sharded (ZeRO-1's update); 'zero' is only the zero-bubble schedule's",
}


def identifiers(text: str) -> set[str]:
    """The names in `text`'s code (not its comments or strings)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {token.string for token in tokens if token.type == tokenize.NAME}


def test_the_scan_reads_names_not_prose():
    code = 'zero = ChunkedLayout(x)  # a ZeroLayout\nhelp = "SplitLayers"\n'
    assert identifiers(code) & set(RETIRED) == {"zero", "ChunkedLayout"}


def test_no_retired_name_is_back_in_hyparflow():
    found = {
        (path, name, RETIRED[name])
        for path, text in python_sources("hyparflow").items()
        for name in identifiers(text) & set(RETIRED)
    }
    assert found == set()
