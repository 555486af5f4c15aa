# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/provider'

Puppet::Type.type(:vmhost_image).provide(:vmhostd) do
  desc <<~DOC
    Talks to vmhostd over its Unix socket (JSON-RPC 2.0, Ruby standard library only). Current
    state comes from one `image.list` per socket (prefetch): an image with a recorded sha256 is
    present with it; a file put there by hand is present with no sha256 (declaring it records
    it). `ensure => present` is `image.import`, `ensure => absent` is `image.delete`, and a
    declared sha256 that differs from the current one is an `image.import` too (it records an
    unrecorded file; vmhostd refuses a recorded image with another sha256, 4093). Nothing is
    sent in noop mode.
  DOC

  # client, instances, prefetch (one image.list per socket), socket, send_call, puppet_error.
  include PuppetX::Vmhost::Provider

  class << self
    def list_method
      'image.list'
    end

    # The provider's view of an image from vmhostd's image view.
    def hash_from_view(view, socket)
      { name: view['name'], ensure: :present, sha256: view['sha256'], source: view['source'],
        used_by: Array(view['used_by']), socket: socket }
    end
  end

  # The current state, read with image.list when prefetch did not provide it.
  def current
    return @property_hash unless @property_hash.empty?

    views = begin
      self.class.client(socket).call('image.list')
    rescue PuppetX::Vmhost::Error => e
      raise puppet_error(e)
    end
    view = Array(views).find { |v| v.is_a?(Hash) && v['name'] == resource[:name] }
    @property_hash = view ? self.class.hash_from_view(view, socket) : { name: resource[:name], ensure: :absent }
  end

  def exists?
    current[:ensure] == :present
  end

  def sha256
    current[:sha256]
  end

  def create
    import
  end

  # The declared sha256 differs from the current one: for a file without a record, vmhostd
  # hashes it where it is and records it; a recorded image with another sha256 is refused
  # (4093), since an image is never replaced.
  def sha256=(_value)
    import
  end

  def destroy
    call('image.delete', { 'name' => resource[:name] })
    @property_hash = { name: resource[:name], ensure: :absent }
  end

  private

  def import
    raise Puppet::Error, "vmhost_image[#{resource[:name]}]: sha256 is required to import an image" if
      resource[:sha256].nil?

    params = { 'name' => resource[:name], 'sha256' => resource[:sha256] }
    params['source'] = resource[:source] unless resource[:source].nil?
    params['timeout_s'] = resource[:timeout_s] unless resource[:timeout_s].nil?
    result = call('image.import', params)
    view = result.is_a?(Hash) ? result['image'] : nil
    @property_hash = self.class.hash_from_view(view, socket) if view.is_a?(Hash)
  end

  def call(method, params)
    timeout = PuppetX::Vmhost::Client::MUTATING_TIMEOUT
    # A download may take up to timeout_s (vmhostd's default when not given).
    timeout += (resource[:timeout_s] || PuppetX::Vmhost::Client::DEFAULT_IMPORT_TIMEOUT_S) if method == 'image.import'
    send_call(method, params, timeout)
  end

  # What puppet_error adds to a refusal: how to get past it.
  def refusal_detail(err)
    case err.code
    when 4093
      '; an image is never replaced (VMs hold overlays over it): delete it first ' \
      '(ensure => absent) or import it under a new name'
    when 4092
      vms = err.details.is_a?(Hash) ? Array(err.details['vms']) : []
      "; the image is the base of VMs #{vms.join(', ')}: destroy them (or change their boot image) first"
    end
  end
end
