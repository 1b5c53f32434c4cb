# Shell helpers shared by the benchmark scripts (scripts/bench-*.sh source this file).

# Prints the median of the numbers on stdin, one a line (the mean of the middle two for an even count).
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

# Prints the TOML of two TUN faces: `a` (device ${tag}ta, whose packets travel down, from the app) and `b` (device
# ${tag}tb, whose packets travel up, from the server).
tun_faces() {
  cat <<TOML
[modules.a]
kind = "tun"
name = "${tag}ta"
[modules.b]
kind = "tun"
name = "${tag}tb"
direction = "up"
TOML
}
