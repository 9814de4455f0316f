# Sourced by the GPU-machine scripts: install the carried wheels (.whl/, see
# ../shared/device/fetch-wheels.sh) beside the image's packages and put the repo's packages on
# the path. Sets $out (results, default $OUT).
out=${OUT:-out/device}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | paste -sd:):${PYTHONPATH:-}
export PATH=/tmp/site/bin:$PATH
