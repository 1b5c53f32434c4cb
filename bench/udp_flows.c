// UDP sender of many flows for scripts/bench-flowscale.sh (issue 16):
//   udp_flows BASE FLOWS PPS SECS
// sends 64-byte datagrams at PPS per second for SECS seconds, round-robin over FLOWS destinations: ports 1024 to
// 65023 of the addresses BASE, BASE+1, ... (64,000 flows an address), from one socket bound to source port 40000,
// so that FLOWS distinct 5-tuples cross the path, the same in every run.
// Prints "sent=N" (datagrams the kernel took; a full queue's refusal is retried, never counted as sent).
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

#define PORTS 64000
#define BATCH 32
#define SRC_PORT 40000

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s BASE FLOWS PPS SECS\n", argv[0]);
    return 2;
  }
  struct in_addr base;
  if (inet_pton(AF_INET, argv[1], &base) != 1) {
    fprintf(stderr, "udp_flows: not an IPv4 address: %s\n", argv[1]);
    return 2;
  }
  long flows = atol(argv[2]), pps = atol(argv[3]);
  double secs = atof(argv[4]);
  if (flows <= 0 || pps <= 0 || secs < 0) {
    fprintf(stderr, "udp_flows: FLOWS and PPS must be positive, SECS not negative\n");
    return 2;
  }
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) die("socket");
  // One source port for every run, so that a second run sends the flows of the first one again.
  struct sockaddr_in src = {.sin_family = AF_INET, .sin_port = htons(SRC_PORT)};
  if (bind(fd, (struct sockaddr *)&src, sizeof src)) die("bind");
  static struct sockaddr_in to[BATCH];
  static struct mmsghdr msg[BATCH];
  static struct iovec iov[BATCH];
  static char payload[64];
  memset(payload, 'f', sizeof payload);
  long total = secs > 0 ? (long)(pps * secs) : flows, sent = 0, next = 0;
  double start = now_us(), gap_us = 1e6 / pps;
  while (sent < total) {
    int n = total - sent < BATCH ? (int)(total - sent) : BATCH;
    for (int i = 0; i < n; i++) {
      long f = next++ % flows;
      to[i] = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons(1024 + f % PORTS)};
      to[i].sin_addr.s_addr = htonl(ntohl(base.s_addr) + (uint32_t)(f / PORTS));
      iov[i] = (struct iovec){payload, sizeof payload};
      msg[i].msg_hdr = (struct msghdr){.msg_name = &to[i], .msg_namelen = sizeof to[i], .msg_iov = &iov[i], .msg_iovlen = 1};
    }
    int done = sendmmsg(fd, msg, n, 0);
    if (done < 0) {
      if (errno == EAGAIN || errno == ENOBUFS) {
        next -= n;
        usleep(100);
        continue;
      }
      die("sendmmsg");
    }
    next -= n - done;
    sent += done;
    if (secs > 0) {
      double due = start + sent * gap_us, now = now_us();
      if (due > now) usleep((useconds_t)(due - now));
    }
  }
  printf("sent=%ld\n", sent);
  return 0;
}
