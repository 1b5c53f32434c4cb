// UDP ping-pong for scripts/bench-latency.sh (issue 16), small enough to add no cost of its own:
//   udp_pp server PORT       echoes every datagram received on 0.0.0.0:PORT back to its sender
//   udp_pp pp HOST PORT N    sends a 64-byte datagram and waits for its echo, N times, one in flight; prints the
//                            median and the 99th percentile round-trip time in microseconds:
//                            "pp median_us=.. p99_us=.. lost=.." (a datagram not echoed within 1 s is lost)
// Exits non-zero with a message on any error.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

static struct sockaddr_in addr_of(const char *host, const char *port) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(port))};
  if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
    fprintf(stderr, "udp_pp: not an IPv4 address: %s\n", host);
    exit(1);
  }
  return a;
}

int main(int argc, char **argv) {
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) die("socket");
  char buf[2048];
  if (argc == 3 && !strcmp(argv[1], "server")) {
    struct sockaddr_in a = addr_of("0.0.0.0", argv[2]);
    if (bind(fd, (struct sockaddr *)&a, sizeof a)) die("bind");
    for (;;) {
      struct sockaddr_in from;
      socklen_t len = sizeof from;
      ssize_t n = recvfrom(fd, buf, sizeof buf, 0, (struct sockaddr *)&from, &len);
      if (n < 0) die("recvfrom");
      if (sendto(fd, buf, n, 0, (struct sockaddr *)&from, len) < 0) die("sendto");
    }
  }
  if (argc == 5 && !strcmp(argv[1], "pp")) {
    struct sockaddr_in a = addr_of(argv[2], argv[3]);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect");
    struct timeval timeout = {.tv_sec = 1};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    int n = atoi(argv[4]), got = 0, lost = 0;
    if (n <= 0) n = 1;
    double *rtt = calloc(n, sizeof *rtt);
    memset(buf, 'p', 64);
    for (int i = 0; i < n; i++) {
      memcpy(buf, &i, sizeof i);
      double t0 = now_us();
      if (send(fd, buf, 64, 0) != 64) die("send");
      for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          lost++;
          break;
        }
        if (r < 0) die("recv");
        int k;
        memcpy(&k, buf, sizeof k);
        if (k == i) {
          rtt[got++] = now_us() - t0;
          break;
        }
      }
    }
    if (!got) {
      fprintf(stderr, "udp_pp: no echo at all\n");
      return 1;
    }
    qsort(rtt, got, sizeof *rtt, cmp);
    printf("pp median_us=%.1f p99_us=%.1f lost=%d\n", rtt[got / 2], rtt[(int)(got * 0.99)], lost);
    return 0;
  }
  fprintf(stderr, "usage: udp_pp server PORT | udp_pp pp HOST PORT N\n");
  return 2;
}
