"""TextStream: incremental text, stop strings held back across tokens and cut out."""

from pdserve.prefill_server.text_stream import TextStream


class ByteDetok:
    """Each token id is one byte; holds back incomplete UTF-8 like the engine's detokenizer."""

    def __init__(self):
        self.buf = b""

    def add(self, ids):
        self.buf += bytes(ids)
        try:
            text = self.buf.decode()
        except UnicodeDecodeError:
            return ""
        self.buf = b""
        return text


def ids(s):
    return list(s.encode())


def test_plain_text_streams_through():
    ts = TextStream(ByteDetok())
    out = "".join(ts.add(ids(c)) for c in "hello") + ts.flush()
    assert out == "hello" and ts.text == "hello" and not ts.stopped


def test_stop_string_across_tokens_is_cut_and_held_back():
    ts = TextStream(ByteDetok(), stop=["END"])
    pieces = [ts.add(ids(c)) for c in "abEN"]
    assert "".join(pieces) == "ab"  # "EN" could start "END": held back
    assert ts.add(ids("Dxyz")) == "" and ts.stopped
    assert ts.text == "ab" and ts.flush() == ""


def test_false_alarm_prefix_is_released():
    ts = TextStream(ByteDetok(), stop=["END"])
    assert ts.add(ids("aE")) == "a"
    assert ts.add(ids("x")) == "Ex"
    assert ts.add(ids("E")) == "" and ts.flush() == "E" and ts.text == "aExE"


def test_multibyte_character_is_not_split():
    ts = TextStream(ByteDetok())
    b = "é".encode()
    assert ts.add([b[0]]) == "" and ts.add([b[1]]) == "é"


def test_flush_emits_a_trailing_partial_character_as_the_tokenizer_decodes_it():
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    ts = TextStream(ByteDetok(), decode=decode)
    assert ts.add(ids("a")) == "a" and ts.add(["é".encode()[0]]) == ""
    assert ts.flush() == "\ufffd" and ts.text == "a\ufffd"
