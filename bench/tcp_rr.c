// TCP helpers for scripts/bench-flows.sh (issue 13), small enough to add no cost of their own:
//   tcp_rr server PORT            an epoll echo server on [::]:PORT (v4 and v6), any number of connections
//   tcp_rr rr HOST PORT N         one connection (TCP_NODELAY), N round trips of 1 byte; prints the median and the
//                                 99th percentile round-trip time in microseconds: "rr median_us=.. p99_us=.."
//   tcp_rr hold HOST PORT N SECS  opens N connections, checks each echoes one byte, prints "held N", keeps them
//                                 open and idle for SECS seconds, then closes them
// Exits non-zero with a message on any error.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

static void raise_nofile(void) {
  struct rlimit r;
  if (getrlimit(RLIMIT_NOFILE, &r) == 0) {
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
  }
}

static int dial(const char *host, const char *port) {
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res;
  int e = getaddrinfo(host, port, &hints, &res);
  if (e) {
    fprintf(stderr, "tcp_rr: %s: %s\n", host, gai_strerror(e));
    exit(1);
  }
  int fd = socket(res->ai_family, SOCK_STREAM, 0);
  if (fd < 0) die("socket");
  if (connect(fd, res->ai_addr, res->ai_addrlen) < 0) die("connect");
  freeaddrinfo(res);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

static void echo_one(int fd) {
  char c = 'x';
  if (write(fd, &c, 1) != 1) die("write");
  if (read(fd, &c, 1) != 1) die("read");
}

static int serve(int port) {
  raise_nofile();
  int ls = socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (ls < 0) die("socket");
  int one = 1, zero = 0;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt(ls, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(port), .sin6_addr = in6addr_any};
  if (bind(ls, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
  if (listen(ls, 4096) < 0) die("listen");
  int ep = epoll_create1(0);
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls};
  epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
  printf("ready\n");
  fflush(stdout);
  static char buf[65536];
  struct epoll_event evs[256];
  for (;;) {
    int n = epoll_wait(ep, evs, 256, -1);
    if (n < 0 && errno != EINTR) die("epoll_wait");
    for (int i = 0; i < n; i++) {
      int fd = evs[i].data.fd;
      if (fd == ls) {
        int c;
        while ((c = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
          setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          struct epoll_event ce = {.events = EPOLLIN, .data.fd = c};
          epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
        }
        continue;
      }
      ssize_t r = read(fd, buf, sizeof buf);
      if (r <= 0) {
        if (r < 0 && errno == EAGAIN) continue;
        close(fd);
        continue;
      }
      // Echo back; the bench's messages are small, so a short write only happens to a dead peer.
      if (write(fd, buf, r) != r) close(fd);
    }
  }
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "server")) return serve(atoi(argv[2]));
  if (argc == 5 && !strcmp(argv[1], "rr")) {
    int n = atoi(argv[4]);
    if (n < 1) n = 1;
    int fd = dial(argv[2], argv[3]);
    for (int i = 0; i < 100; i++) echo_one(fd);  // warm up
    double *t = malloc(sizeof(double) * n);
    for (int i = 0; i < n; i++) {
      double s = now_us();
      echo_one(fd);
      t[i] = now_us() - s;
    }
    qsort(t, n, sizeof *t, cmp);
    printf("rr median_us=%.1f p99_us=%.1f\n", t[n / 2], t[(int)(n * 0.99)]);
    return 0;
  }
  if (argc == 6 && !strcmp(argv[1], "hold")) {
    raise_nofile();
    int n = atoi(argv[4]);
    int *fds = malloc(sizeof(int) * n);
    for (int i = 0; i < n; i++) {
      fds[i] = dial(argv[2], argv[3]);
      echo_one(fds[i]);
    }
    printf("held %d\n", n);
    fflush(stdout);
    sleep(atoi(argv[5]));
    for (int i = 0; i < n; i++) close(fds[i]);
    return 0;
  }
  fprintf(stderr, "usage: tcp_rr server PORT | rr HOST PORT N | hold HOST PORT N SECS\n");
  return 2;
}
