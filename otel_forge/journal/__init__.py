"""A write-ahead journal: records appended to a file by one process, tailed by another.

The writer's appends land in the page cache with one ``pwrite`` each, so they survive the writing
process's death (SIGKILL included); only a crash of the node loses what was not synced. The reader
hands out each record with the file offset just after it, the cursor a consumer saves once it has
delivered that record. The framing is leveldb's log format (``framing``): a record torn by a kill
is recognised and skipped, never half-returned.
"""

from otel_forge.journal.reader import JournalReader
from otel_forge.journal.writer import JournalWriter

__all__ = ["JournalReader", "JournalWriter"]
