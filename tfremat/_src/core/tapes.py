"""The gradient tapes open on each thread, tracked from when tfremat is
imported (docs/design.md, "What importing tfremat does")."""

import threading

from tensorflow.python.eager import backprop

__all__ = [
    "thread_list",
]


_thread = threading.local()


def thread_list(name):
  """A list kept per thread: gradient tapes, forward passes."""
  if not hasattr(_thread, name):
    setattr(_thread, name, [])
  return getattr(_thread, name)


def _install_tape_hooks():
  """Tracks the gradient tapes open on each thread, for `ForwardOps`.

  Installed once, when tfremat is imported, and left in place: outside a
  forward pass it only keeps a per-thread list of open tapes.
  """
  if getattr(backprop.GradientTape.__enter__, "_tfremat_hook", False):
    return
  enter, exit_ = backprop.GradientTape.__enter__, backprop.GradientTape.__exit__

  def hooked_enter(self):
    forwards = thread_list("forwards")
    forward = forwards[-1] if forwards else None
    if forward is not None:
      forward.inner_tape_entered()
    try:
      result = enter(self)
    except BaseException:
      if forward is not None:
        forward.inner_tape_exited()
      raise
    self._tfremat_forward = forward  # pylint: disable=protected-access
    thread_list("tapes").append(self)
    return result

  def hooked_exit(self, *args):
    try:
      return exit_(self, *args)
    finally:
      tapes = thread_list("tapes")
      if self in tapes:
        tapes.remove(self)
      forward = getattr(self, "_tfremat_forward", None)
      if forward is not None:
        self._tfremat_forward = None  # pylint: disable=protected-access
        forward.inner_tape_exited()

  hooked_enter._tfremat_hook = True  # pylint: disable=protected-access
  backprop.GradientTape.__enter__ = hooked_enter
  backprop.GradientTape.__exit__ = hooked_exit


_install_tape_hooks()
