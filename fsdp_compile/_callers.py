"""Which library function a call comes from (``torch.distributed.checkpoint``'s state-dict helpers, Hugging Face's
and peft's ``save_pretrained``): where the library must refuse what such a caller asks, its error can say how to do
what the caller meant. Read from the Python stack, only on those paths."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["caller"]


def caller(path: tuple[str, ...], name: Callable[[str], bool]) -> str | None:
    """The name of the outermost function on the stack whose file path ends with ``path`` (folders, then the file:
    ``("distributed", "checkpoint", "state_dict.py")``) or holds it (``("transformers",)``: any file under a folder
    of that name) and whose name ``name`` accepts; None if there is none."""
    suffix, folder = os.path.join(*path), os.sep + os.path.join(*path) + os.sep
    found, frame = None, sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if (filename.endswith(suffix) or folder in filename) and name(frame.f_code.co_name):
            found = frame.f_code.co_name
        frame = frame.f_back
    return found
