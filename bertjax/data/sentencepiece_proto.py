"""SentencePiece's model file format (`ModelProto`), read and written without importing the
module sentencepiece generated for it: sentencepiece 0.2.3's `sentencepiece_model_pb2` refuses a
protobuf runtime older than the one it was generated with (7.36), and apache-beam
(`bertjax[beam]`) holds protobuf below 7. The message class is made from the file descriptor
that module carries, which any protobuf runtime of the last years reads.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from google.protobuf import descriptor_pool, message_factory


@functools.cache
def model_proto_class() -> type:
  """The `sentencepiece.ModelProto` message class (nested `SentencePiece`, its `Type` values)."""
  source = Path(importlib.util.find_spec("sentencepiece.sentencepiece_model_pb2").origin)
  serialized = next(ast.literal_eval(node.args[0]) for node in ast.walk(ast.parse(
      source.read_text())) if isinstance(node, ast.Call) and isinstance(
          node.func, ast.Attribute) and node.func.attr == "AddSerializedFile")
  pool = descriptor_pool.DescriptorPool()
  pool.AddSerializedFile(serialized)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("sentencepiece.ModelProto"))
