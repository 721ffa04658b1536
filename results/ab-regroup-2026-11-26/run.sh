#!/usr/bin/env bash
# alternate whole bench runs of two checkouts (each its own coordinator and actors)
set -u
py=/work/main/.venv/bin/python
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then root=/tmp/ab/before; else root=/work/main; fi
    (cd $root && PYTHONPATH=$root:$root/integrations/verl:$root/integrations/vllm timeout 600 $py -m weightsync.cli bench \
      --transport shm ipc broadcast --baselines --checksum on --rounds 1 --versions 4 --warmup 2 --no-progress \
      --json /tmp/ab/$side-$i.json > /tmp/ab/$side-$i.log 2>&1; echo "$side $i rc=$?")
  done
done
