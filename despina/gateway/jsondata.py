"""JSON numbers and tensors: a tensor's JSON data to its raw bytes, checked, and a float tensor's values
back to JSON without losing a NaN or an infinity. Shared by the V2 bodies, function URLs and generate."""
from __future__ import annotations

import itertools
import struct
from typing import Any

import numpy as np
import orjson

from ..contract.datatypes import V2_TO_NUMPY, element_count, serialize_bytes
from ..contract.errors import InvalidArgument


def _flatten(data: Any) -> tuple[list[Any], set[type]]:
    """Nested lists -> (one flat list, the types in it), a level at a time in C (chain); a level that
    mixes lists and scalars stays as it is, for the caller's count and type checks to refuse."""
    if type(data) is not list:
        return [data], {type(data)}
    flat = data
    kinds = set(map(type, flat))
    while flat and kinds == {list}:
        flat = list(itertools.chain.from_iterable(flat))
        kinds = set(map(type, flat))
    return flat, kinds


# struct's codes for the numeric datatypes: struct.pack converts a list of Python numbers in one C
# pass, twice as fast as numpy does (the float to float32 rounding the same), and refuses any other
# object, but for booleans, which it takes as ints
PACKED = {"UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT8": "b", "INT16": "h",
          "INT32": "i", "INT64": "q", "FP16": "e", "FP32": "f", "FP64": "d"}


FLOAT_EXACT = 2.0**53  # floats below it in magnitude hold every whole number, and no other


def holds_no_booleans(raw: bytes) -> bool:
    """True when a JSON document has no true, false (or null) anywhere: every such literal has an r or
    an l, and these bytes are found at memchr's speed. A document with them may still have none."""
    return raw.find(b"r") < 0 and raw.find(b"l") < 0


DATA, ID = b'"data"', b'"id"'
# a V2 document with its arrays and its id emptied, where the arrays were, and the id (data_template)
Template = tuple[bytes, list[tuple[int, int]], bytes | None]


def data_holds_no_booleans(doc: bytes) -> bool:
    """For a V2 request's JSON, valid and already parsed, whose tensors' values are its "data" members:
    True when no "data" member's value has a true or a false in it, though the document may have them
    elsewhere (perf_analyzer asks for its outputs with "binary_data": false). False where not known.

    In a document without an escape each '"data"' in it is a whole string, the key "data" among them,
    and a value ends before the next string begins unless it holds strings, whose values do not pack as
    numbers anyway. So it is enough that no t or f byte lies between each '"data"' and the next quote:
    memchr's work (0.3 µs on perf_analyzer's 6 KB body, against 3.7 for the type check on its 256
    numbers). A document with a backslash is not looked into."""
    if holds_no_booleans(doc):
        return True
    if doc.find(b"\\") >= 0:  # "d\u0061ta" is a "data" key too
        return False
    find = doc.find
    at = find(DATA)
    while at >= 0:
        start = at + len(DATA)
        end = find(b'"', start)
        if end < 0:
            end = len(doc)
        if find(b"t", start, end) >= 0 or find(b"f", start, end) >= 0:
            return False
        at = find(DATA, end)
    return True


JSON_SPACE = b" \t\n\r"  # what JSON takes for space (bytes.strip() would take \v and \f as well)


def data_template(doc: bytes, longest: int) -> Template | None:
    """The document with each "data" member's array emptied, and where the arrays of numbers are; with
    them the string of its one "id" member emptied too, and what it held (None where the document has no
    "id" string, or more than one). None unless the document is of the plain kind: no escape (each
    '"data"' and '"id"' is then a whole string), each "data" a key whose value is a flat array with no
    string in it, or one such array inside another (`[[...]]`: a one-row batch as numpy's tolist() writes
    it; the span is the inner array's, and the template says `[[]]`), and the rest no longer than
    `longest`. Equal templates differ in what was emptied alone: the arrays hold no bracket or quote, the
    id no quote, that could move what is found."""
    found = _arrays(doc)
    if found is None:
        return None
    spans, emptied = found
    pieces: list[bytes] = []
    last = 0
    for start, end, instead in emptied:
        pieces += (doc[last:start], instead)
        last = end
    pieces.append(doc[last:])
    template = b"".join(pieces)  # every string of the document is whole in it: the arrays held none
    strings = []  # of "id" keys: the request's own, or another's (in its parameters, say)
    at = template.find(ID)
    while at >= 0:
        at += len(ID)
        quote = template.find(b'"', at)
        if quote > 0 and template[at:quote].strip() == b":":
            strings.append((quote + 1, template.find(b'"', quote + 1)))
        at = template.find(ID, at)
    own_id = None
    if len(strings) == 1 and strings[0][1] > strings[0][0]:  # an empty one stays (perf_analyzer's "id": "")
        begin, end = strings[0]
        own_id, template = template[begin:end], template[:begin] + template[end:]
    return (template, spans, own_id) if len(template) <= longest else None


def _arrays(doc: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int, bytes]]] | None:
    """data_template's finding: where the "data" members' arrays of numbers are, and what each member's
    value is in the template (its start, end, and what it says instead); None where the document is not
    of the plain kind, or has no "data" member."""
    if doc.find(b"\\") >= 0:
        return None
    find = doc.find
    spans: list[tuple[int, int]] = []
    emptied: list[tuple[int, int, bytes]] = []  # what the template leaves out, and what it says instead
    at = find(DATA)
    while at >= 0:
        key_end = at + len(DATA)
        start = find(b"[", key_end)
        if start < 0 or doc[key_end:start].strip() != b":":
            return None
        end = find(b"]", start) + 1
        if end <= 0 or find(b'"', start, end) >= 0:
            return None
        inner = find(b"[", start + 1, end)
        if inner < 0:
            spans.append((start, end))
            emptied.append((start, end, b"[]"))
        else:  # one row: nothing but JSON's space around the inner array (emptied with it), no third bracket
            close = find(b"]", end)
            if (doc[start + 1:inner].strip(JSON_SPACE) or find(b"[", inner + 1, end) >= 0 or close < 0
                    or doc[end:close].strip(JSON_SPACE)):
                return None
            spans.append((inner, end))
            emptied.append((start, close + 1, b"[[]]"))
            end = close + 1
        at = find(DATA, end)
    return (spans, emptied) if spans else None


# A "data" array longer than this is parsed this much at a time (a chunk ends at the comma after it): parsed
# whole, its numbers' Python objects and orjson's document of them took 10 times its text's memory, 50
# times the tensor's (bench/copies.py); a chunk's are a chunk's.
CHUNK_BYTES = 1 << 18
SPAN = "\x00"  # a marker string's start, which no document this way holds: it has no escape (_arrays)


class Unvouched(Exception):
    """A Span's numbers are not plainly numbers of its tensor: the document is decoded the long way."""


class Span:
    """A "data" member's flat array of numbers, where it is in its document, not parsed yet (skeleton)."""

    __slots__ = ("doc", "start", "end")

    def __init__(self, doc: bytes, start: int, end: int) -> None:
        self.doc, self.start, self.end = doc, start, end

    def packed(self, datatype: str, count: int) -> bytes:
        code = PACKED.get(datatype)
        packed = None if code is None else packed_span(self.doc, self.start, self.end, code, count)
        if packed is None:
            raise Unvouched
        return packed


def skeleton(doc: bytes) -> dict[str, Any] | None:
    """A large V2 request's JSON parsed without its tensors' numbers: each input's "data" a Span of its
    array, packed when its datatype and shape are known (json_data_to_bytes), a chunk at a time. None where
    the document is not of the plain kind (_arrays), or has a "data" member other than its inputs' own:
    the caller parses it whole."""
    found = _arrays(doc)
    if found is None:
        return None
    spans, emptied = found
    pieces: list[bytes] = []
    last = 0
    for i, (start, end, _) in enumerate(emptied):
        pieces += (doc[last:start], b'"\\u0000%d"' % i)
        last = end
    pieces.append(doc[last:])
    try:
        parsed = orjson.loads(b"".join(pieces))
    except orjson.JSONDecodeError:
        return None
    inputs = parsed.get("inputs") if type(parsed) is dict else None
    if type(inputs) is not list:
        return None
    placed = 0
    for raw in inputs:
        marker = raw.get("data") if type(raw) is dict else None
        if type(marker) is str and marker[:1] == SPAN:
            raw["data"] = Span(doc, *spans[int(marker[1:])])
            placed += 1
    return parsed if placed == len(spans) else None


def packed_span(doc: bytes, start: int, end: int, code: str, count: int) -> bytes | None:
    """The flat JSON array doc[start:end] as `count` numbers packed by struct's `code`, parsed CHUNK_BYTES
    at a time; None where it is not plainly that many numbers (a true, false, null or NaN among them, a
    number out of the datatype's range, an integer datatype's float): the long way says what is wrong, or
    converts them as it does."""
    find = doc.find
    if find(b"t", start, end) >= 0 or find(b"f", start, end) >= 0:  # true, false (or Infinity)
        return None
    view = memoryview(doc)
    pieces: list[bytes] = []
    at, last, total = start + 1, end - 1, 0  # within the brackets
    try:
        while True:
            cut = find(b",", at + CHUNK_BYTES, last) if at + CHUNK_BYTES < last else -1
            stop = last if cut < 0 else cut
            values = orjson.loads(b"[" + view[at:stop] + b"]")
            if not values and (pieces or cut >= 0):  # nothing between two commas
                return None
            total += len(values)
            if total > count:
                return None
            pieces.append(struct.pack(f"<{len(values)}{code}", *values))
            if cut < 0:
                break
            at = cut + 1
    except (orjson.JSONDecodeError, struct.error, TypeError, OverflowError):
        return None
    return b"".join(pieces) if total == count else None


def json_data_to_bytes(name: str, datatype: str, shape: list[int], data: Any, booleans: bool = True
                       ) -> bytes:
    """An input's JSON data (nested lists or a flat list, row-major) -> its raw little-endian bytes;
    InvalidArgument when it is not `shape`'s count of values of `datatype`. `booleans=False` says the
    document holds none (holds_no_booleans), sparing the numbers' type check. A Span (skeleton) is packed
    by its text, or raises Unvouched."""
    if type(data) is Span:
        return data.packed(datatype, element_count(shape))
    code = PACKED.get(datatype)
    if code is not None:
        packed = _packed(code, element_count(shape), data, booleans)
        if packed is not None:
            return packed
    # anything the quick way does not take goes the long way, which says what is wrong with it, or
    # converts it as numpy does (a whole float for an integer datatype, a value out of a float's range)
    return converted(name, datatype, shape, data)


def converted(name: str, datatype: str, shape: list[int], data: Any) -> bytes:
    """json_data_to_bytes the long way, by numpy: any datatype, any data, the error for each."""
    flat, kinds = _flatten(data)
    count = element_count(shape)
    if len(flat) != count:
        raise InvalidArgument(f"input '{name}': 'data' has {len(flat)} elements; shape {shape} needs "
                              f"{count}")
    # bool is its own type here, not an int
    if datatype == "BYTES":
        if not kinds <= {str}:
            raise InvalidArgument(f"input '{name}': BYTES data must be strings")
        array = np.empty(count, dtype=np.object_)
        array[:] = [x.encode() for x in flat]
        return serialize_bytes(array)
    if datatype == "BOOL":
        if not kinds <= {bool}:
            raise InvalidArgument(f"input '{name}': BOOL data must be true or false")
    elif not kinds <= {int, float}:
        raise InvalidArgument(f"input '{name}': {datatype} data must be numbers")
    elif float in kinds and np.dtype(V2_TO_NUMPY[datatype]).kind in "iu":  # numpy would cut 2.7 to 2
        fraction = next((x for x in flat if type(x) is float and not x.is_integer()), None)
        if fraction is not None:
            raise InvalidArgument(f"input '{name}': {datatype} data must be whole numbers, not {fraction!r}")
        # past 2**53 a float is not every whole number: the JSON parser reads an integer below INT64's
        # range as one, and -9223372036854775809 became INT64's minimum
        inexact = next((x for x in flat if type(x) is float and abs(x) >= FLOAT_EXACT), None)
        if inexact is not None:
            raise InvalidArgument(f"input '{name}': " + (
                _misfit(datatype, flat) or f"{datatype} data past 2**53 must be written as integers, not "
                f"{inexact!r} (a float there may not be the number sent)"))
    try:
        with np.errstate(over="ignore"):  # past a float's range is its infinity, as in Triton
            array = np.asarray(flat, dtype=V2_TO_NUMPY[datatype])
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"input '{name}': {_misfit(datatype, flat) or exc}") from None
    return array.tobytes()


def _misfit(datatype: str, flat: list[Any]) -> str | None:
    """What numpy refused in `flat`, said plainly: the first number outside an integer datatype's range
    (numpy's own words name a C long, or the value as a Python integer, for any integer type)."""
    dtype = np.dtype(V2_TO_NUMPY[datatype])
    if dtype.kind not in "iu":
        return None
    info = np.iinfo(dtype)
    wrong = next((x for x in flat if not info.min <= x <= info.max), None)
    if wrong is None:
        return None
    return f"{wrong!r} is out of range for {datatype} ({info.min} to {info.max})"


def _packed(code: str, count: int, data: Any, booleans: bool) -> bytes | None:
    """Numbers packed by struct, or None where they are not plainly `count` ints and floats."""
    flat = data
    try:
        while type(flat) is list and flat and type(flat[0]) is list:
            flat = list(itertools.chain.from_iterable(flat))
        if type(flat) is not list or len(flat) != count or (booleans and bool in set(map(type, flat))):
            return None
        return struct.pack(f"<{count}{code}", *flat)
    except (struct.error, TypeError, OverflowError):  # a string, a null, a level that mixes, a range
        return None


def nonfinite_json(value: Any, array: np.ndarray) -> Any:
    """`value` (`array`, or its nested lists) as orjson writes it, or where the array holds a NaN or an
    infinity, its JSON with those written as NaN, Infinity and -Infinity: what Triton's rapidjson writes
    and tritonclient, perf_analyzer and Python's json read. orjson would write null, and the value
    would be lost."""
    if array.dtype.kind != "f" or np.isfinite(array).all():
        return value
    odd = array[~np.isfinite(array)].tolist()  # in the order JSON writes them: row-major
    parts = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).split(b"null")  # numbers: nulls are those
    words = [b"NaN" if v != v else b"Infinity" if v > 0 else b"-Infinity" for v in odd]
    return orjson.Fragment(b"".join(itertools.chain.from_iterable(zip(parts, [*words, b""]))))
