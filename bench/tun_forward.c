/* A trivial TUN <-> TUN forwarder: the reference the benchmarks compare flexstack's TUN faces with
 * (scripts/bench-datapath.sh, bench-latency.sh, bench-hostpath.sh).
 * usage: tun_forward [-o] [-t] NAME_A NAME_B   (creates both devices, forwards until killed)
 *   default: read()/write(), one packet per system call, no offloads, one thread polling both devices;
 *   -o: virtio-net headers and the TUN offloads (TUN_F_CSUM, TSO4, TSO6): GSO super-packets of up to 64 KiB pass
 *       whole, their checksums left to the kernel, as a vhost-style forwarder does;
 *   -t: one thread per direction, each blocked in read() on its device. */
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#define VNET_HDR_LEN 10
#define BUF_LEN (65536 + VNET_HDR_LEN)

static int offloads;

static int open_tun(const char *name) {
  int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC);
  if (fd < 0) { perror("open /dev/net/tun"); return -1; }
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (offloads ? IFF_VNET_HDR : 0);
  strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
  if (ioctl(fd, TUNSETIFF, &ifr) < 0) { perror("TUNSETIFF"); return -1; }
  if (offloads) {
    int len = VNET_HDR_LEN;
    if (ioctl(fd, TUNSETVNETHDRSZ, &len) < 0) { perror("TUNSETVNETHDRSZ"); return -1; }
    if (ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN) < 0) {
      perror("TUNSETOFFLOAD");
      return -1;
    }
  }
  return fd;
}

struct half { int from, to; };

/* One direction, blocking: what a full queue would drop on write is dropped. */
static void *forward(void *arg) {
  struct half *h = arg;
  static __thread char buf[BUF_LEN];
  for (;;) {
    ssize_t n = read(h->from, buf, sizeof buf);
    if (n < 0) { perror("read"); return NULL; }
    if (n > 0 && write(h->to, buf, (size_t)n) < 0) { /* dropped */ }
  }
}

int main(int argc, char **argv) {
  int threads = 0, opt;
  while ((opt = getopt(argc, argv, "ot")) != -1) {
    if (opt == 'o') offloads = 1;
    else if (opt == 't') threads = 1;
    else { fprintf(stderr, "usage: %s [-o] [-t] NAME_A NAME_B\n", argv[0]); return 2; }
  }
  if (argc - optind != 2) { fprintf(stderr, "usage: %s [-o] [-t] NAME_A NAME_B\n", argv[0]); return 2; }
  int fd[2] = { open_tun(argv[optind]), open_tun(argv[optind + 1]) };
  if (fd[0] < 0 || fd[1] < 0) return 1;
  printf("ready\n");
  fflush(stdout);
  if (threads) {
    static struct half h[2];
    pthread_t t[2];
    for (int i = 0; i < 2; i++) {
      h[i] = (struct half){ fd[i], fd[1 - i] };
      if (pthread_create(&t[i], NULL, forward, &h[i]) != 0) { perror("pthread_create"); return 1; }
    }
    pthread_join(t[0], NULL);
    return 1;
  }
  static char buf[BUF_LEN];
  struct pollfd p[2] = { { fd[0], POLLIN, 0 }, { fd[1], POLLIN, 0 } };
  for (;;) {
    if (poll(p, 2, -1) < 0) { perror("poll"); return 1; }
    for (int i = 0; i < 2; i++) {
      if (p[i].revents & POLLIN) {
        ssize_t n = read(fd[i], buf, sizeof buf);
        if (n > 0 && write(fd[1 - i], buf, (size_t)n) < 0) { /* dropped, as a full queue would */ }
      }
    }
  }
}
