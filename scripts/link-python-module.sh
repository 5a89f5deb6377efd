#!/usr/bin/env bash
# Puts the build tree's `porter` Python package on the path, as `pip install -e` would: a
# porter-build.pth (one line, the build tree's python/ folder) in the first site directory of
# Debian's /usr/bin/python3 and, when it is another interpreter, of the python3 first on PATH
# (a pyenv or venv python3, say) where that one can load the built module (the same extension
# suffix, e.g. .cpython-311-x86_64-linux-gnu.so). An interpreter whose site directory is not
# writable is named, with the PYTHONPATH to use instead. Delete the .pth files to undo it.
# Usage: scripts/link-python-module.sh BUILD_PYTHON_DIR   (make build runs it)
set -euo pipefail
dir=$(cd "${1:?usage: link-python-module.sh BUILD_PYTHON_DIR}" 2>/dev/null && pwd) || {
  echo "python: $1 does not exist: the porter module was not built (pybind11-dev, python3-dev)"
  exit 0
}
shopt -s nullglob
modules=("$dir"/porter/_porter*.so)
if [ ${#modules[@]} -eq 0 ]; then
  echo "python: the porter module was not built (pybind11-dev, python3-dev)"
  exit 0
fi
module=$(basename "${modules[0]}")

seen=""
for py in /usr/bin/python3 "$(command -v python3 || true)"; do
  [ -n "$py" ] && [ -x "$py" ] || continue
  exe=$("$py" -c 'import sys; print(sys.executable)' 2>/dev/null) || continue
  case " $seen " in *" $exe "*) continue ;; esac
  seen="$seen $exe"
  suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX") or "")')
  if [ -z "$suffix" ] || [ "${module%"$suffix"}" = "$module" ]; then
    echo "python: $exe cannot load $module (its modules end in ${suffix:-?}); use /usr/bin/python3"
    continue
  fi
  site=$("$py" -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null) || site=""
  if [ -n "$site" ] && mkdir -p "$site" 2>/dev/null && [ -w "$site" ]; then
    echo "$dir" > "$site/porter-build.pth"
    echo "python: $exe imports porter from $dir ($site/porter-build.pth)"
  else
    echo "python: ${site:-the site directory of $exe} is not writable; use PYTHONPATH=$dir"
  fi
done
