"""The exceptions tfremat raises.

Every message starts with `tfremat: `, so that in a long Keras or TensorFlow
traceback what tfremat refused stands apart from what TensorFlow did. Each
class is also the built-in exception callers already catch (`ValueError`,
`TypeError`, ...), so `except ValueError:` keeps working.
"""

__all__ = [
    "PREFIX",
    "BudgetUnreachableError",
    "Error",
    "InvalidArgumentError",
    "InvalidTypeError",
    "MissingAttributeError",
    "RerunMismatchError",
    "UnreplayableOpError",
    "UnsupportedError",
]

PREFIX = "tfremat: "


class Error(Exception):
  """The base of tfremat's errors: its message starts with `tfremat: `.

  The prefix is added when the message is shown, not in `__init__`: AutoGraph
  re-raises an error from traced code with its own class only when the class
  takes a plain message (`Exception.__init__`); otherwise a `tf.function`'s
  caller sees a StagingError instead. Its message then holds the original
  one, prefix and all, after "in user code:" and the traced lines.
  """

  __init__ = Exception.__init__

  def __str__(self):
    message = super().__str__()
    return message if PREFIX in message else PREFIX + message


class InvalidArgumentError(Error, ValueError):
  """An argument's value is wrong; the message names it and the fix."""


class BudgetUnreachableError(InvalidArgumentError):
  """No rematerialization plan fits the memory budget asked for.

  Besides the message, which says what holds the lowest bound up, it carries
  that bound for a program to act on: `lowest_bytes`, and `lowest_fraction`,
  the same as a fraction of the measured peak without rematerialization,
  the form `budget=` takes. Refused on measurements, it is the lowest bound
  a measured plan had; refused on the weight gradients alone, the lowest
  any plan can have, which a plan may still measure above. Peaks move a
  little from measurement to measurement: retry a little above it.
  """

  lowest_bytes = None
  lowest_fraction = None

  @classmethod
  def of(cls, message, lowest_bytes, reference_bytes):
    """The error for `message`, whose lowest bound is `lowest_bytes` of
    `reference_bytes`, the peak without rematerialization."""
    error = cls(message)
    error.lowest_bytes = int(lowest_bytes)
    error.lowest_fraction = lowest_bytes / max(1, reference_bytes)
    return error


class InvalidTypeError(Error, TypeError):
  """An argument is of a type tfremat does not take."""


class MissingAttributeError(Error, AttributeError):
  """A Params has no parameter of that name."""


class UnsupportedError(Error, NotImplementedError):
  """What was asked needs something this TensorFlow, Keras or layer lacks."""


class UnreplayableOpError(Error, ValueError):
  """The rematerialized function uses an op whose effect cannot be replayed
  (a stateful random op, a direct variable write): the message names the op
  and the fix."""


class RerunMismatchError(Error, ValueError):
  """The backward-pass rerun did not compute what the forward pass did: the
  message shows where the two passes' ops part."""
