# Sourced after venv.sh: install the pinned SGLang and the modules its cache imports, on CPU.
# The registry's CUDA torch build (SGLang's pin) runs on CPU; a CPU torch breaks torchvision.
stamp="$venv/.sglang-$(sha1sum "$root/requirements/sglang-cpu.txt" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  "$venv/bin/python" -m pip install -q -r "$root/requirements/sglang-cpu.txt"
  "$venv/bin/python" -m pip install -q --no-deps sglang==0.5.23
  rm -f "$venv"/.sglang-*
  touch "$stamp"
fi
