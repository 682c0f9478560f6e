"""rosbag2 files (sqlite3 and mcap) without a ROS install: read them as rclpy messages, write them
from rclpy messages.

Bags store each message as CDR bytes, the same bytes rclpy sends over DDS, so reading hands the
raw bytes to rclpy's own deserializer (no second message model) and writing serializes with
rclpy. The `rosbags` library does the file formats; it needs a message's definition only to
describe a topic in a bag it writes (the schema and type hash readers check), and it knows the
standard ROS types but not ours: those are registered from the .msg files of this package (the
source tree's msg/, else the installed share/photon_ros/msg), and any other missing type from
the `.msg` files of installed ROS packages.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, overload

from rclpy.serialization import deserialize_message, serialize_message

STORAGES = ("sqlite3", "mcap")
PACKAGE = "photon_ros"
SOURCE_MSG_DIR = Path(__file__).resolve().parent.parent / "msg"


class BagError(Exception):
    """A bag that cannot be read or written as asked; the message says why and what to do."""


@dataclass
class BagMessage:
    topic: str
    msgtype: str          # e.g. "sensor_msgs/msg/Image"
    log_time_ns: int      # when the recorder received it: the bag's timeline
    msg: Any              # the rclpy message, its header stamp as recorded


def message_class(msgtype: str) -> type:
    """The rclpy class of "pkg/msg/Type" (or "pkg/Type"); BagError when it is not installed."""
    parts = msgtype.split("/")
    if len(parts) == 2:
        parts = [parts[0], "msg", parts[1]]
    if len(parts) != 3 or not all(parts):
        raise BagError(f"{msgtype!r} is not a ROS message type name (pkg/msg/Type)")
    package, kind, name = parts
    try:
        return getattr(importlib.import_module(f"{package}.{kind}"), name)
    except (ImportError, AttributeError):
        raise BagError(f"message type {msgtype} is not installed here (no Python module "
                       f"{package}.{kind}.{name}): source the workspace that builds it") from None


def bag_topics(path: str | Path) -> dict[str, str]:
    """topic -> message type of every topic in the bag (one of them for a topic recorded with
    several, which read_messages refuses: a bag is not refused for a topic it need not replay)."""
    with _open_reader(path) as reader:
        return {c.topic: c.msgtype for c in reader.connections}


@dataclass
class Undecodable:
    """A recorded message rclpy cannot deserialize (a damaged record)."""
    topic: str
    msgtype: str
    log_time_ns: int
    error: str


def read_messages(path: str | Path, topics: list[str],
                  undecodable: list[Undecodable] | None = None) -> Iterator[BagMessage]:
    """The messages of `topics` in the bag's order (log time), deserialized by rclpy. A message
    that cannot be deserialized is appended to `undecodable` and skipped when that list is given;
    without it, BagError names the message. BagError for a topic recorded with several types."""
    with _open_reader(path) as reader:
        connections = [c for c in reader.connections if c.topic in topics]
        missing = set(topics) - {c.topic for c in connections}
        if missing:
            raise BagError(f"{path}: no topic {', '.join(sorted(missing))} "
                           f"(it has {', '.join(sorted(c.topic for c in reader.connections))})")
        types: dict[str, set[str]] = {}
        for c in connections:
            types.setdefault(c.topic, set()).add(c.msgtype)
        # one publisher replays a topic: another type's messages on it would fail mid-replay
        # (several connections of one type, one per recording publisher, are fine)
        for topic, kinds in sorted(types.items()):
            if len(kinds) > 1:
                raise BagError(f"{path}: topic {topic} was recorded with several message types "
                               f"({', '.join(sorted(kinds))}): a topic is replayed as one type")
        classes = {c.id: message_class(c.msgtype) for c in connections}
        for connection, log_time, raw in _records(path, reader.messages(connections=connections)):
            try:
                msg = deserialize_message(bytes(raw), classes[connection.id])
            except Exception as err:  # noqa: BLE001 - rclpy's RMWError, or anything bad bytes cause
                bad = Undecodable(connection.topic, connection.msgtype, log_time, " ".join(str(err).split()))
                if undecodable is None:
                    raise BagError(f"{path}: the {connection.msgtype} message on {connection.topic} "
                                   f"logged at {log_time} ns cannot be decoded ({bad.error})") from None
                undecodable.append(bad)
                continue
            yield BagMessage(connection.topic, connection.msgtype, log_time, msg)


def _records(path: Path, records: Iterator[Any]) -> Iterator[Any]:
    """The storage's records, a damaged file said as a BagError naming it: rosbags raises what the
    broken bytes cause (an mcap overwritten in the middle: OverflowError), a traceback and exit 1
    where the evaluator promises exit 2 for input it cannot use."""
    read = 0
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except Exception as err:  # noqa: BLE001 - whatever the damage makes the reader raise
            raise BagError(f"{path}: damaged after {read} messages, cannot be read on "
                           f"({type(err).__name__}: {' '.join(str(err).split())})") from None
        read += 1
        yield record


class StreamedMessages(Sequence[BagMessage]):
    """One topic's messages, read twice rather than held: once up front for what is known before a
    replay (each one's log time and header stamp; the rest of it, an image's pixels, dropped),
    then in order as they are asked for (`self[i].msg` reads on from the last one asked for; going
    back starts the bag over). 900 raw 640x480 frames held ~0.9 GB; a robot's ten minutes, 16."""

    def __init__(self, path: str | Path, topic: str, undecodable: list[Undecodable] | None = None) -> None:
        self.path, self.topic = Path(path), topic
        self._index: list[tuple[str, int, int | None]] = [
            (m.msgtype, m.log_time_ns, stamp_ns(m.msg)) for m in read_messages(path, [topic], undecodable)]
        self._reader: Iterator[BagMessage] | None = None
        self._at, self._last = -1, None   # the message the reader gave last, and its index
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, i: int) -> BagMessage: ...
    @overload
    def __getitem__(self, i: slice) -> list[BagMessage]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        msgtype, log_time_ns, _ = self._index[i]
        return _LazyMessage(self.topic, msgtype, log_time_ns, self, i)

    def stamp_of(self, i: int) -> int | None:
        """Message i's header stamp (ns), known without reading it again."""
        return self._index[i][2]

    def message(self, i: int) -> Any:
        with self._lock:
            if i == self._at:
                return self._last
            if self._reader is None or i < self._at:
                self._reader, self._at = read_messages(self.path, [self.topic], []), -1
            for m in self._reader:   # (the undecodable were skipped the first time too)
                self._at, self._last = self._at + 1, m.msg
                if self._at == i:
                    return m.msg
            raise BagError(f"{self.path}: {self.topic} ended before its message {i} on a second read")


class _LazyMessage(BagMessage):
    """A BagMessage whose `msg` is read from the bag when asked for (StreamedMessages)."""

    def __init__(self, topic: str, msgtype: str, log_time_ns: int, source: StreamedMessages, index: int) -> None:
        self.topic, self.msgtype, self.log_time_ns = topic, msgtype, log_time_ns
        self._source, self._index = source, index

    @property   # type: ignore[override]
    def msg(self) -> Any:
        return self._source.message(self._index)


def _open_reader(path: str | Path):
    from rosbags.rosbag2 import Reader, ReaderError

    path = Path(path)
    if not path.exists():
        raise BagError(f"{path}: no such bag (a rosbag2 folder with metadata.yaml, or a .mcap / .db3 file)")
    try:
        reader = Reader(path)
        reader.open()
    except (ReaderError, FileNotFoundError, KeyError, ValueError) as err:
        raise BagError(f"{path}: cannot read it as a rosbag2 bag ({STORAGES[0]} or {STORAGES[1]}): {err}") from None
    except Exception as err:  # noqa: BLE001 - what damaged bytes make the storage raise (OverflowError, struct.error)
        raise BagError(f"{path}: damaged, cannot be read ({type(err).__name__}: {' '.join(str(err).split())})") from None
    return contextlib.closing(reader)   # already open: the Reader's own `with` would open it again


# --- writing --------------------------------------------------------------------------------------
def typestore():
    """rosbags' Kilted type store plus this package's message definitions."""
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    store.register(_package_types(_package_msg_dir()))
    return store


def _package_msg_dir() -> Path | None:
    if SOURCE_MSG_DIR.is_dir():
        return SOURCE_MSG_DIR
    return next((d for d in _share_dirs(PACKAGE, "msg") if d.is_dir()), None)


def _share_dirs(package: str, kind: str) -> list[Path]:
    prefixes = [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p]
    return [Path(prefix) / "share" / package / kind for prefix in prefixes]


def _package_types(msg_dir: Path | None) -> dict:
    from rosbags.typesys import get_types_from_msg

    types: dict = {}
    for path in sorted(msg_dir.glob("*.msg")) if msg_dir else ():
        types.update(get_types_from_msg(path.read_text(), f"{PACKAGE}/msg/{path.stem}"))
    return types


def _register_installed(store, msgtype: str) -> None:
    """Register `msgtype`, and the types it uses, from the .msg files of installed packages."""
    from rosbags.typesys import get_types_from_msg

    pending = [msgtype]
    while pending:
        name = pending.pop()
        if name in store.types:
            continue
        package, _, typename = name.split("/")
        path = next((d / f"{typename}.msg" for d in _share_dirs(package, "msg")
                     if (d / f"{typename}.msg").is_file()), None)
        if path is None:
            raise BagError(f"cannot write {name} to a bag: no definition of it here (rosbags does not "
                           f"know it and no share/{package}/msg/{typename}.msg is on AMENT_PREFIX_PATH)")
        types = get_types_from_msg(path.read_text(), name)
        store.register(types)
        for _, fields in types.values():
            pending += [_field_type(f) for f in fields if _field_type(f)]


def _field_type(field) -> str | None:
    """The message type a rosbags field description names: (NAME, "pkg/msg/Type"), or one inside
    an ARRAY / SEQUENCE description ((element description), size); None for plain values."""
    from rosbags.interfaces import Nodetype

    _, (node, detail) = field
    if node in (Nodetype.ARRAY, Nodetype.SEQUENCE):
        node, detail = detail[0]
    return detail if node == Nodetype.NAME else None


class BagWriter:
    """Write rclpy messages to a new bag: `with BagWriter(path, "mcap") as bag: bag.write(...)`."""

    def __init__(self, path: str | Path, storage: str = "sqlite3") -> None:
        from rosbags.rosbag2 import StoragePlugin, Writer, WriterError

        if storage not in STORAGES:
            raise BagError(f"unknown bag storage {storage!r}: one of {', '.join(STORAGES)}")
        self.path = Path(path)
        if self.path.exists():
            raise BagError(f"{self.path} exists already: bags are never overwritten, choose another path")
        plugin = StoragePlugin.SQLITE3 if storage == "sqlite3" else StoragePlugin.MCAP
        try:
            self._writer = Writer(self.path, version=Writer.VERSION_LATEST, storage_plugin=plugin)
        except WriterError as err:
            raise BagError(str(err)) from None
        self._store = typestore()
        self._connections: dict[tuple[str, str], Any] = {}

    def __enter__(self) -> "BagWriter":
        self._writer.open()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self._writer.close()
        else:
            self._writer.abort()

    def write(self, topic: str, msg: Any, time_ns: int) -> None:
        """Append `msg` on `topic` at log time `time_ns`; its type is taken from the message."""
        self.write_serialized(topic, msgtype_of(msg), time_ns, serialize_message(msg))

    def write_serialized(self, topic: str, msgtype: str, time_ns: int, data: bytes) -> None:
        """Append a message already serialized (CDR bytes, as recorded) on `topic` at `time_ns`."""
        key = (topic, msgtype)
        if key not in self._connections:
            if msgtype not in self._store.types:
                _register_installed(self._store, msgtype)
            self._connections[key] = self._writer.add_connection(topic, msgtype, typestore=self._store)
        self._writer.write(self._connections[key], int(time_ns), bytes(data))


def msgtype_of(msg: Any) -> str:
    """"pkg/msg/Type" of an rclpy message instance."""
    module = type(msg).__module__.split(".")   # e.g. sensor_msgs.msg._image
    return f"{module[0]}/{module[1]}/{type(msg).__name__}"


def stamp_ns(msg: Any) -> int | None:
    """The message's header stamp in nanoseconds; None for messages without a header."""
    header = getattr(msg, "header", None)
    if header is None:
        return None
    return header.stamp.sec * 1_000_000_000 + header.stamp.nanosec


def bag_storage(path: str | Path) -> str:
    """"sqlite3" or "mcap": how the bag stores its messages."""
    path = Path(path)
    if path.is_file():
        return "mcap" if path.suffix == ".mcap" else "sqlite3"
    import yaml

    try:
        info = yaml.safe_load((path / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
        storage = info["storage_identifier"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as err:
        raise BagError(f"{path}: unreadable metadata.yaml ({err})") from None
    if storage not in STORAGES:
        raise BagError(f"{path}: storage {storage!r} is not supported (only {', '.join(STORAGES)})")
    return storage
