"""Lingvo-style Params: define, set, copy, nest, text round trip, errors."""

import os
import subprocess
import sys
import textwrap

import pytest

from tfremat import hyperparams


def _params():
  p = hyperparams.Params()
  p.Define("dims", 512, "Model width.")
  p.Define("activation", "relu", "Activation name.")
  p.Define("dropout", hyperparams.Params(), "Dropout settings.")
  p.dropout.Define("keep_prob", 0.9, "Probability to keep.")
  p.Define("layers", [hyperparams.Params(), hyperparams.Params()], "Subs.")
  for i, sub in enumerate(p.layers):
    sub.Define("width", 10 * (i + 1), "Width.")
  p.Define("shape", (2, 3), "A tuple.")
  p.Define("table", {"a": 1}, "A dict.")
  p.Define("cls", hyperparams.Params, "A class.")
  p.Define("none", None, "Nothing yet.")
  return p


def test_define_set_get_and_chaining():
  p = _params()
  assert p.dims == 512 and p.Get("dropout.keep_prob") == 0.9
  assert p.Set(dims=64, activation="gelu") is p
  assert (p.dims, p.activation) == (64, "gelu")
  p.dropout.keep_prob = 0.5
  assert p.Get("dropout.keep_prob") == 0.5
  assert "dims" in p and "dimz" not in p


def test_copy_is_deep_but_shares_classes():
  p = _params()
  q = p.Copy()
  q.dropout.keep_prob = 0.1
  q.layers[0].width = 99
  q.table["a"] = 2
  assert p.dropout.keep_prob == 0.9 and p.layers[0].width == 10
  assert p.table == {"a": 1}
  assert q.cls is hyperparams.Params
  assert p.Copy() == p and q != p


def test_text_written_before_the_lingvo_package_still_loads():
  # Params text names classes by module; the flat paths of earlier versions
  # (tfremat.hyperparams, tfremat.builder_layers) still resolve.
  p = _params()
  text = p.ToText().replace("tfremat.lingvo.hyperparams", "tfremat.hyperparams")
  assert "type/tfremat.hyperparams/Params" in text
  assert _params().Set(cls=None).FromText(text) == p


def test_text_form_lists_every_value_and_round_trips():
  p = _params()
  text = p.ToText()
  assert text.splitlines() == [
      "activation : 'relu'",
      "cls : type/tfremat.lingvo.hyperparams/Params",
      "dims : 512",
      "dropout.keep_prob : 0.9",
      "layers[0].width : 10",
      "layers[1].width : 20",
      "none : None",
      "shape : (2, 3)",
      "table : {'a': 1}",
  ]
  assert str(p) == text
  q = _params().Set(dims=1, activation="x", shape=(1,), cls=None)
  q.dropout.keep_prob = 0.0
  q.layers[1].width = 0
  assert q.FromText(text) is q
  assert q == p


def test_undefined_names_raise_with_close_matches():
  p = _params()
  with pytest.raises(AttributeError, match="'dimz' is not defined.*dims"):
    p.dimz = 3
  with pytest.raises(AttributeError, match="'keep' is not defined.*keep_prob"):
    p.dropout.Get("keep")
  with pytest.raises(AttributeError, match="activaton.*activation"):
    p.Set(dims=3, activaton="relu")
  assert p.dims == 512  # Set checks every name before changing any.
  with pytest.raises(AttributeError, match="already defined"):
    p.Define("dims", 1, "Again.")
  with pytest.raises(ValueError, match="not a valid parameter name"):
    p.Define("Bad-Name", 1, "No.")


def test_from_text_errors_change_nothing():
  p = _params()
  with pytest.raises(AttributeError, match="dimz.*dims"):
    p.FromText("dims : 3\ndimz : 4\n")
  with pytest.raises(ValueError, match="cannot parse the value of activation"):
    p.FromText("dims : 3\nactivation : relu\n")
  with pytest.raises(ValueError, match="expected 'name : value'"):
    p.FromText("dims = 3\n")
  assert p.dims == 512


def test_instantiable_params():

  class Thing:

    def __init__(self, params):
      self.size = params.size

  p = hyperparams.InstantiableParams(Thing)
  p.Define("size", 3, "Size.")
  assert hyperparams.IsInstantiable(p)
  assert not hyperparams.IsInstantiable(hyperparams.Params())
  assert p.Set(size=7).Instantiate().size == 7
  with pytest.raises(ValueError, match="no cls"):
    hyperparams.InstantiableParams().Instantiate()


# Issue "Keras and Lingvo users' first hour" [10]: Params as Lingvo users
# know them (Lingvo's hyperparams_test covers Get, Delete and IterParams).

def test_get_and_set_take_the_names_to_text_prints():
  p = _params()
  for line in p.ToText().splitlines():
    name, _, value = line.partition(" : ")
    if not value.startswith("type/"):
      assert repr(p.Get(name)) == value, name
  assert p.Get("layers[1].width") == 20
  p.Set(**{"layers[0].width": 7, "dropout.keep_prob": 0.5})
  assert p.layers[0].width == 7 and p.dropout.keep_prob == 0.5
  with pytest.raises(AttributeError, match="not an item of a list of Params"):
    p.Get("layers[5].width")
  with pytest.raises(AttributeError, match="'widht' is not defined.*width"):
    p.Set(**{"dims": 1, "layers[1].widht": 3})
  assert p.dims == 512  # Nothing was set.


def test_delete_removes_names_after_checking_all():
  p = _params()
  assert p.Delete("none", "dropout.keep_prob") is p
  assert "none" not in p and "keep_prob" not in p.dropout
  with pytest.raises(AttributeError, match="'dimz' is not defined"):
    p.Delete("dims", "dimz")
  assert "dims" in p


def test_iter_params_yields_names_and_values():
  p = _params()
  items = dict(p.IterParams())
  assert list(items) == sorted(items) == list(p)
  assert items["dims"] == 512 and items["dropout"] is p.dropout
  assert p.Description("dropout.keep_prob") == "Probability to keep."


def test_to_text_of_a_script_is_read_back_by_another_program(tmp_path):
  # A builder subclass defined in a script lives in __main__; its text form
  # named type/__main__/..., which means the reader itself there.
  script = tmp_path / "my_experiment.py"
  script.write_text(textwrap.dedent("""
      import tfremat

      class MyBuilder(tfremat.builder.Base):
        pass

      if __name__ == "__main__":
        p = MyBuilder.Params().Set(random_seed=3)
        print(p.ToText(), end="")
  """))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  text = subprocess.run([sys.executable, str(script)], env=env, check=True,
                        capture_output=True, text=True).stdout
  assert "cls : type/my_experiment/MyBuilder" in text, text
  reader = textwrap.dedent("""
      import sys
      import tfremat
      p = tfremat.builder.Base.Params().FromText(sys.stdin.read())
      print(p.cls.__module__, p.cls.__name__, p.random_seed)
  """)
  read = subprocess.run([sys.executable, "-c", reader], input=text,
                        env=dict(env, PYTHONPATH=str(tmp_path)), check=True,
                        capture_output=True, text=True).stdout
  assert read.split() == ["my_experiment", "MyBuilder", "3"]
  # Without the script's directory on sys.path the error says what to do.
  with pytest.raises(ValueError, match="PYTHONPATH"):
    _params().FromText("cls : type/my_experiment/MyBuilder\n")


def test_to_text_of_a_script_is_read_back_by_the_script_itself(tmp_path):
  # In the program that wrote it, type/my_experiment/MyBuilder names
  # __main__'s class: importing my_experiment again would run its top-level
  # code a second time and make a second, different MyBuilder.
  script = tmp_path / "my_experiment.py"
  script.write_text(textwrap.dedent("""
      import tfremat

      print("top-level code runs")

      class MyBuilder(tfremat.builder.Base):
        pass

      if __name__ == "__main__":
        p = MyBuilder.Params().Set(random_seed=3)
        fresh = tfremat.builder.Base.Params().FromText(p.ToText())
        print(fresh.cls is MyBuilder, fresh.random_seed)
  """))
  out = subprocess.run(
      [sys.executable, str(script)], check=True, capture_output=True,
      text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout
  assert out.splitlines() == ["top-level code runs", "True 3"], out
