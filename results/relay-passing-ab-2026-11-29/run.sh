set -u
for i in 1 2 3; do
  for side in a b; do
    d=/work/main; [ $side = a ] && d=/work/ab-a
    cd $d && PYTHONPATH=$d:$d/benchmarks timeout 600 /work/main/.venv/bin/python -m weightsync.cli bench --hosts 5 --trainer-ranks 2x2 --receivers 2 --link-gbit 1 --rounds 2 --json /tmp/ab/$side$i.json --no-progress > /tmp/ab/$side$i.txt 2>&1
    echo "$side$i rc=$?" >> /tmp/ab/log
  done
done
