# Sourced by the shell scripts here: the Python ($PY) and the selfspec command ($SELFSPEC) they run.
# $PY and $SELFSPEC win; else the active virtual environment's; else this clone's .venv (the
# README's set-up commands make it); else the first on PATH.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PY:-} ]]; then
  if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then PY=$VIRTUAL_ENV/bin/python
  elif [[ -x $_root/.venv/bin/python ]]; then PY=$_root/.venv/bin/python
  else PY=$(command -v python3 || command -v python || echo python3)
  fi
fi
if [[ -z ${SELFSPEC:-} ]]; then
  if [[ -x $(dirname "$PY")/selfspec ]]; then SELFSPEC=$(dirname "$PY")/selfspec
  else SELFSPEC=$(command -v selfspec || echo selfspec)
  fi
fi
unset _root
export PY SELFSPEC
